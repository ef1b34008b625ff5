"""How nb_helpers.compat's probes look at a library: a name and its signature imported or read from source, a
CUDA-only binding, bitsandbytes' ctypes kernels and the argument counts its own calls pass, and the QuantState and
optimizer fields we read. nb_helpers.compat holds the inventory (one Check per private use) and runs them; nothing
imports eagerly."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from pkgutil import resolve_name as _resolve  # "pkg.module.Class.attr": imports what it can, then getattr


# --- how probes look at a library ---------------------------------------------------------------------------------
def _norm(code: str) -> str:  # source without its formatting: a reformat upstream is no false alarm
    return ast.unparse(ast.parse(textwrap.dedent(code)))


def _at(path: str, attrs=(), kind=None, value=None, text="", params=(), first=(), says=()):
    """A probe of `path`: it exists (a `kind`, equal to `value`, printing as `text`) with `attrs`; its signature has
    `params` and starts with `first` (what we pass by position); its source still `says` each snippet."""
    def probe():
        obj = _resolve(path)
        if kind is callable and not callable(obj) or isinstance(kind, type) and not isinstance(obj, kind):
            return f"{path} is a {type(obj).__name__}"
        if value is not None and obj != value or text and text not in str(obj):
            return f"{path} is {obj}, not the {value or text} we rely on"
        if missing := [a for a in attrs if not hasattr(obj, a)]:
            return f"{path} has no {', '.join(missing)}"
        sig = inspect.signature(obj).parameters if params or first else {}
        if missing := [n for n in params if n not in sig]:
            return f"{path} has no parameter {', '.join(missing)}"
        if tuple(sig)[:len(first)] != tuple(first):
            return f"{path} takes {tuple(sig)[:len(first)]} first, we pass {first}"
        code = _norm(inspect.getsource(obj)) if says else ""
        missing = [s for s in says if _norm(s) not in code]
        return f"{path} no longer does `{missing[0]}`" if missing else None
    return probe


def _source(module: str) -> str:
    """A module's source, unimported (bitsandbytes' CUDA ops and liger's Triton ops need a GPU); a loaded one's file."""
    loaded = sys.modules.get(module)
    if getattr(loaded, "__file__", None):
        return Path(loaded.__file__).read_text(encoding="utf-8")
    top, *rest = module.split(".")
    if (spec := importlib.util.find_spec(top)) is None or not spec.submodule_search_locations:
        raise ImportError(f"{top} is not installed")
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return (base / "__init__.py" if base.is_dir() else base.with_suffix(".py")).read_text(encoding="utf-8")


def _def(tree, qualname: str):
    for name in qualname.split("."):
        tree = next((n for n in getattr(tree, "body", []) if getattr(n, "name", None) == name), None)
    return tree


def _in_source(module: str, qualname: str, first=(), params=(), says=()):
    """_at's signature and source checks for a function read from source, not imported."""
    def probe():
        if (node := _def(ast.parse(_source(module)), qualname)) is None:
            return f"{module}.{qualname} is gone"
        have = [a.arg for a in node.args.posonlyargs + node.args.args]
        if missing := set(params) - set(have) - {a.arg for a in node.args.kwonlyargs}:
            return f"{qualname} has no parameter {', '.join(sorted(missing))}"
        if missing := [s for s in says if _norm(s) not in ast.unparse(node)]:
            return f"{qualname} no longer does `{missing[0]}`"
        return None if tuple(have[:len(first)]) == first else f"{qualname} takes {have}, we pass {first}"
    return probe


def _c_binding(name: str) -> str | None:
    """A CUDA-only binding: the CPU build lacks it, so there torch's stubs or its trace rules must still name it."""
    import torch
    if torch.version.cuda:
        return None if callable(getattr(torch._C, name, None)) else f"torch._C has no {name}"
    text = "".join(p.read_text(encoding="utf-8") for p in map(Path(torch.__file__).parent.joinpath, (
        "_C/__init__.pyi", "_dynamo/trace_rules.py")) if p.exists())
    return None if f"def {name}(" in text or f"torch._C.{name}" in text else f"torch no longer names _C.{name}"


# --- bitsandbytes' C kernels, called through ctypes ---------------------------------------------------------------
BNB_OPS = "bitsandbytes.backends.cuda.ops"
QUANTS = ("nf4", "fp4")
DEQUANT_4BIT = [f"cdequantize_blockwise_{d}_{q}" for d in ("bf16", "fp16", "fp32") for q in QUANTS]
ADAM_8BIT, ADAM_32BIT = ([f"cadam{kind}_grad_{d}" for d in ("fp32", "fp16", "bf16")]  # the order of our dtype tables
                         for kind in ("_8bit_blockwise", "32bit"))


def _kernels(function: str, symbols: list[str], nargs: int, table: str | None = None):
    """bitsandbytes' own call of these symbols passes `nargs` arguments, as ours does (source; a CUDA build's lib)."""
    def probe():
        tree = ast.parse(_source(BNB_OPS))
        if (fn := _def(tree, function)) is None:
            return f"{BNB_OPS}.{function} is gone"
        named = [n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "lib"]
        if table:  # the module-level dict: table = {"adam": (lib.<fp32>, lib.<fp16>, lib.<bf16>), ...}
            named = [e.attr for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", 0) == table
                     for k, v in zip(n.value.keys, n.value.values) if getattr(k, "value", 0) == "adam" for e in v.elts]
        if table and named != symbols or set(symbols) - set(named):
            return f"{table or function} no longer holds lib.{', lib.'.join(symbols)} as we index them"
        bound, assigns, seeds = set(), [n for n in ast.walk(fn) if isinstance(n, ast.Assign)], {"lib", table}
        while new := {t.id for a in assigns if {n.id for n in ast.walk(a.value) if isinstance(n, ast.Name)}
                      & (bound | seeds) for t in a.targets if isinstance(t, ast.Name)} - bound:
            bound |= new  # locals bound, through any chain of assignments, to lib or to the kernel table
        arities = {len(c.args) for c in ast.walk(fn) if isinstance(c, ast.Call) and (  # the kernel calls
            isinstance(c.func, ast.Name) and c.func.id in bound
            or isinstance(c.func, ast.Attribute) and getattr(c.func.value, "id", None) == "lib")}
        if arities != {nargs}:
            return f"{function} passes {sorted(arities)} arguments, we pass {nargs}"
        from bitsandbytes import cextension
        if not isinstance(cextension.lib, getattr(cextension, "CudaBNBNativeLibrary", ())):
            return None  # the CPU build: no CUDA kernels to look up, the source is the check
        import bitsandbytes.backends.cuda.ops  # noqa: F401 - declares the kernels' argument types
        bad = [s for s in symbols if getattr(cextension.lib._lib, s, None) is None
               or not table and len(getattr(cextension.lib._lib, s).argtypes or ()) != nargs]
        return f"the loaded library's {bad[0]} is missing or not declared with {nargs} arguments" if bad else None
    return probe


def _quant_state() -> str | None:
    """The fields fused_lora and models.memory_breakdown read; the block sizes the planner counts."""
    import torch
    from bitsandbytes.functional import quantize_4bit
    _, s = quantize_4bit(torch.ones(256, 256, dtype=torch.bfloat16), quant_type="nf4", compress_statistics=True)
    fields = ("absmax", "code", "shape", "dtype", "blocksize", "quant_type", "offset", "nested", "state2")
    if (missing := [a for a in fields if not hasattr(s, a)]) or not all(hasattr(s.state2, a) for a in (
            "code", "absmax", "blocksize")):
        return f"QuantState has no {', '.join(missing) or 'state2.code/absmax/blocksize'}"
    return None if (s.blocksize, s.state2.blocksize) == (64, 256) else "blocks are not (64, 256) as the planner counts"


def _nf4_layout() -> str | None:
    """What fast.nf4_kernel computes: bitsandbytes' NF4 weight is code[nibble] x absmax (fp32, rounded once), two
    weights a byte with the high nibble first, blocks of 64 in row-major order. Checked on bitsandbytes' CPU kernels,
    whose bits its CUDA kernel gives too (tests/test_nf4_kernel.py)."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    weight = torch.linspace(-1, 1, 4 * 64).view(4, 64).pow(3).to(torch.bfloat16)
    packed, state = quantize_4bit(weight, quant_type="nf4", compress_statistics=False)
    byte = packed.view(-1)
    nibbles = torch.stack([byte >> 4, byte & 15], dim=1).view(-1).long()
    by_hand = (state.code[nibbles].view(-1, 64) * state.absmax.view(-1, 1)).view(state.shape).to(torch.bfloat16)
    if state.code.numel() != 16 or state.code.dtype != torch.float32:
        return f"the NF4 code table is {state.code.numel()} {state.code.dtype} values, not 16 fp32"
    return None if torch.equal(dequantize_4bit(packed, state), by_hand) else "NF4 is no longer code[nibble] x absmax"


def _optimizer() -> str | None:
    """What optimizer_step reads on bitsandbytes' AdamW (a real one), and the state keys its init_state makes."""
    import torch
    from bitsandbytes.optim import PagedAdamW8bit, optimizer
    opt = PagedAdamW8bit([torch.nn.Parameter(torch.zeros(8))])
    reads = {"initialized": opt, "optimizer_name": opt, "pid2config": opt.mng, "index2config": opt.mng,
             "max_unorm": opt.args, "skip_zeros": opt.args}
    if missing := [name for name, owner in reads.items() if not hasattr(owner, name)]:
        return f"PagedAdamW8bit has no {', '.join(missing)}"
    init = _def(ast.parse(_source(optimizer.__name__)), "Optimizer2State.init_state")
    keys = {n.slice.value for n in ast.walk(init) if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)}
    missing = {"step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"} - keys
    return f"init_state no longer makes {sorted(missing)}" if missing else None



def _peft_keys() -> str | None:
    """peft's key matching does what the adapter check (compat.adapter_keys) relies on: a list of names matches a key
    or its last parts, exclude_modules wins, a string matches the whole key, rank_pattern is found by its name."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists as targets
    from peft.utils.other import get_pattern_key

    listed = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], exclude_modules=["layers.1.self_attn.q_proj"])
    pattern, key = LoraConfig(target_modules=r".*\.0\..*q_proj"), "model.layers.{}.self_attn.{}_proj"
    cases = [(listed, key.format(0, "q"), True), (listed, key.format(0, "k"), False),
             (listed, key.format(1, "q"), False), (pattern, key.format(0, "q"), True),
             (pattern, key.format(10, "q"), False)]
    if wrong := [k for config, k, want in cases if bool(targets(config, k)) != want]:
        return f"check_target_module_exists answers otherwise for {wrong[0]}"
    found = (get_pattern_key(["v_proj", "mlp.up_proj"], key.format(3, "v")), get_pattern_key(["v_proj"], "lm_head"))
    return None if found == ("v_proj", "lm_head") else f"get_pattern_key gives {found}, not ('v_proj', 'lm_head')"

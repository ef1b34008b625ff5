"""DPO (notebook 07) on one CUDA GPU under the GTX 1650 preset: peak memory beside the planner's prediction
(nb_helpers.plan.preference), and tokens/s, for the course's DPO against TRL's plain DPO recipe in the same call.
Each run is a fresh process, its allocator capped where the card's would be (nb_helpers.plan.cards: its budget less
its CUDA context).

Models: random-weight models of public shapes (bench/build_tinyllama_shape.py): TinyLlama-1.1B and, for a second
family, Qwen2.5-0.5B. Workloads: pairs of prompt + answer at 256, 512 and 1,024 tokens (the prompt 55% of the
length, the rejected answer a few tokens shorter than the chosen one), 8 pairs per optimizer step.

Runs at each point:
  plain     TRL's DPO recipe as its docs write it for QLoRA: DPOTrainer(model=the 4-bit model, peft_config=
            LoraConfig(r=8, q,k,v,o)), a fresh adapter, the reference = the adapter disabled; 1 x 8, gradient
            checkpointing, paged_adamw_8bit, nothing from nb_helpers but the budget cap and the measurement.
  ours      notebook 07: the DPOConfig of nb_helpers.dpo.dpo_arguments, on a PeftModel with an adapter (standing for
            the SFT one), so TRL adds its frozen "ref" copy; 1 x 8 with checkpointing, as the plain recipe.
  ours-fit  the same with the micro-batch and checkpointing the planner picks: the fewest micro-steps predicted to fit
            the card (5% margin), same 8 pairs a step, checkpointing off where that fits too.
Reported per run: median s/step after warm-up, non-padding tokens/s (TRL's count: chosen and rejected), peak NVML
device-used GiB (this GPU's context), peak reserved, the planner's peak for this GPU (its measured context and
capability) with the relative error, and the planner's peak for the GTX 1650 itself. The fast path
(nb_helpers.fast) is not used: it wires SFTTrainer only.

    python bench/dpo.py                                   # a run file in bench/results/runs/, prints a table
    python bench/dpo.py --out-dir $OUT                    # on the lent device (copy back with cp)
    python bench/dpo.py --shapes tinyllama-1.1b --seqs 512 --runs plain,ours
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_file import RunFile, add_out_dir  # noqa: E402

WARMUP = 3
PAIRS_PER_STEP = 8
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPT_SHARE = 0.55


# --- data ---------------------------------------------------------------------------------------------------------
def write_pairs(tokenizer, path: Path, count: int, seq: int, seed: int) -> float:
    """Text pairs of about `seq` tokens with the longer answer (TRL appends EOS); returns the answers' share."""
    words = (ROOT / "data" / "train.jsonl").read_text(encoding="utf-8").replace('"', " ").split()
    rng = random.Random(seed)

    def text_of(n: int) -> str:
        ids = []
        while len(ids) < n:
            ids = tokenizer(" ".join(rng.choice(words) for _ in range(2 * n)), add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids[:n])

    prompt_len = int(PROMPT_SHARE * seq)
    answer = seq - 1 - prompt_len
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            chosen = text_of(answer)
            f.write(json.dumps({"prompt": text_of(prompt_len), "chosen": chosen,
                                "rejected": text_of(answer - 1 - rng.randrange(16))}) + "\n")
    return 1 - PROMPT_SHARE


# --- the plan -----------------------------------------------------------------------------------------------------
def course_config(spec: dict):
    from nb_helpers.config import RunConfig

    return RunConfig(model=spec["model"], card="gtx1650", max_length=spec["seq"], micro_batch_size=spec["batch"],
                     grad_accum=spec["accum"], gradient_checkpointing=spec["gc"], compute_dtype=spec["dtype"],
                     dpo_max_steps=spec["steps"], eval_steps=0, optim="paged_adamw_8bit", lora_r=8, lora_alpha=16,
                     target_modules=QKVO)


def predictions(spec: dict, context_gib: float | None) -> dict:
    """The planner's peak for this GPU (its measured context and capability) and for the GTX 1650 itself."""
    from nb_helpers.plan.dtypes import cuda_capability
    from nb_helpers.plan.planner import load_shape
    from nb_helpers.plan.preference import plan_preference_for_config

    cfg, shape = course_config(spec), load_shape(spec["model"])
    here = plan_preference_for_config(cfg.replace(card=None, budget_gib=None), shape, context_gib=context_gib,
                                      gpu_capability=cuda_capability(), completion_fraction=spec["answer_share"])
    card = plan_preference_for_config(cfg, shape, completion_fraction=spec["answer_share"])
    return {"predicted_here_gib": here.peak_gib, "predicted_phase": here.peak_phase,
            "predicted_gtx1650_gib": card.peak_gib, "gtx1650_budget_gib": card.budget_gib,
            "predicted_components_gib": {k: round(v / 2**30, 4) for k, v in here.components.items() if v}}


def fitted(spec: dict) -> tuple[int, int, bool]:
    """The planner's pick for the card: the fewest micro-steps predicted to fit (5% margin), GC off where it fits."""
    from nb_helpers.plan.planner import FIT_MARGIN, load_shape
    from nb_helpers.plan.preference import plan_preference_for_config

    shape = load_shape(spec["model"])
    for batch in (8, 4, 2, 1):
        for gc in (False, True):
            plan = plan_preference_for_config(course_config({**spec, "batch": batch, "accum": PAIRS_PER_STEP // batch,
                                                             "gc": gc}), shape, completion_fraction=spec["answer_share"])
            if plan.peak_gib <= plan.budget_gib * (1 - FIT_MARGIN):
                return batch, PAIRS_PER_STEP // batch, gc
    return 1, PAIRS_PER_STEP, True


# --- workers (each in its own process) ----------------------------------------------------------------------------
def worker(spec: dict) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from nb_helpers.dpo import adapt_dpo_trainer, dpo_arguments
    from nb_helpers.plan.budget import enforce_budget
    from nb_helpers.plan.cards import budget_of, run_card
    from nb_helpers.plan.memory import memory_snapshot, record_nvml_baseline

    record_nvml_baseline(0)
    cfg = course_config(spec)
    budget = enforce_budget(budget_of(cfg), 0, run_card(cfg).context_gib)
    dtype = getattr(torch, spec["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, device_map={"": 0}, quantization_config=
                                                 BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                    bnb_4bit_use_double_quant=True,
                                                                    bnb_4bit_compute_dtype=dtype))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=QKVO, task_type="CAUSAL_LM")
    records, clock = [], {}

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            clock.setdefault("t", time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            now = time.perf_counter()
            clock["pending"] = {"step": state.global_step, "step_s": now - clock["t"], **memory_snapshot()}
            clock["t"] = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and clock.get("pending"):
                records.append({**clock.pop("pending"), "loss": logs["loss"], "num_tokens": logs.get("num_tokens")})

    data = load_dataset("json", data_files=spec["data"], split="train")
    if spec["recipe"] == "plain":
        args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=spec["batch"],
                         gradient_accumulation_steps=spec["accum"], gradient_checkpointing=spec["gc"],
                         optim="paged_adamw_8bit", learning_rate=5e-6, bf16=spec["dtype"] == "bfloat16",
                         fp16=spec["dtype"] == "float16", max_length=spec["seq"], max_steps=spec["steps"],
                         logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=42)
        trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=lora, callbacks=[Measure()])
    else:
        for param in model.parameters():
            param.requires_grad_(False)
        model = get_peft_model(model, lora)  # stands for the SFT adapter notebook 07 starts from
        args = DPOConfig(**dpo_arguments(cfg, tempfile.mkdtemp(), has_eval=False))
        trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[Measure()])
        adapt_dpo_trainer(trainer, cfg)
    trainer.train()
    return {"records": records, "context_gib": budget.context_gib, "allocator_cap_gib": budget.allocator_cap_gib}


def summarize(spec: dict, result: dict) -> dict:
    records = result["records"]
    timed = records[WARMUP:]
    step_s = statistics.median(r["step_s"] for r in timed) if timed else None
    counts = [r["num_tokens"] for r in records if r.get("num_tokens") is not None]
    tokens = (counts[-1] - counts[WARMUP - 1]) / len(timed) if timed and len(counts) == len(records) else None
    peak = lambda key: max((r[key] for r in records if r.get(key) is not None), default=None)  # noqa: E731
    out = {"micro_batch": spec["batch"], "accum": spec["accum"], "gc": spec["gc"], "median_step_s": step_s,
           "tokens_per_s": tokens / step_s if tokens and step_s else None, "peak_device_gib": peak("device_used_gib"),
           "peak_reserved_gib": peak("torch_peak_gib"), "peak_allocated_gib": peak("torch_peak_allocated_gib"),
           "context_gib": result.get("context_gib"), "losses": [round(r["loss"], 4) for r in records],
           **predictions(spec, result.get("context_gib"))}
    if out["peak_device_gib"]:
        out["planner_error"] = out["predicted_here_gib"] / out["peak_device_gib"] - 1
    return out


# --- driver -------------------------------------------------------------------------------------------------------
def run_one(spec: dict, work: Path) -> dict:
    spec_path, result_path = work / f"{spec['id']}.json", work / f"{spec['id']}.out"
    spec_path.write_text(json.dumps(spec))
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(result_path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    row = {"recipe": spec["recipe"], "dtype": spec["dtype"], "wall_s": round(time.time() - t0, 1),
           "returncode": proc.returncode}
    if result_path.exists():
        row.update(summarize(spec, json.loads(result_path.read_text())))
    else:
        row.update(micro_batch=spec["batch"], accum=spec["accum"], gc=spec["gc"], **predictions(spec, None))
    if proc.returncode != 0:
        row["error_tail"] = (proc.stderr or proc.stdout)[-2000:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tinyllama-1.1b,qwen2.5-0.5b")
    parser.add_argument("--seqs", default="256,512,1024")
    parser.add_argument("--runs", default="plain,ours,ours-fit")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="compute dtype of every run (the GTX 1650 computes in float16)")
    parser.add_argument("--steps", type=int, default=WARMUP + 8)
    parser.add_argument("--out", default=None, help="write the run file exactly here (default: --out-dir)")
    add_out_dir(parser)
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(worker(spec)))
        return
    import torch
    from build_tinyllama_shape import shape_dir
    from transformers import AutoTokenizer

    if not torch.cuda.is_available():
        sys.exit("bench/dpo.py needs a CUDA GPU")
    run_file = RunFile("dpo", out_dir=args.out_dir, out=args.out)
    out = {"card": "gtx1650", "pairs_per_step": PAIRS_PER_STEP, "warmup_steps": WARMUP, "dtype": args.dtype,
           "points": []}
    work = Path(tempfile.mkdtemp(prefix="dpo-"))
    for shape in args.shapes.split(","):
        model_dir = shape_dir(shape)
        for seq in (int(s) for s in args.seqs.split(",")):
            data = work / f"{shape}-{seq}.jsonl"
            share = write_pairs(AutoTokenizer.from_pretrained(model_dir), data, PAIRS_PER_STEP * args.steps, seq, seq)
            base = dict(model=str(model_dir), data=str(data), seq=seq, steps=args.steps, dtype=args.dtype,
                        answer_share=share, batch=1, accum=PAIRS_PER_STEP, gc=True)
            for name in args.runs.split(","):
                spec = {**base, "recipe": "plain" if name == "plain" else "ours", "id": f"{shape}-{seq}-{name}"}
                if name == "ours-fit":
                    spec["batch"], spec["accum"], spec["gc"] = fitted(spec)
                row = {"shape": shape, "seq": seq, "run": name, **run_one(spec, work)}
                out["points"].append(row)
                print(f"[dpo] {shape:<15}{seq:>6} {name:<9}{row['micro_batch']}x{row['accum']} gc={row['gc']!s:<5} "
                      f"{row.get('median_step_s') or float('nan'):7.3f} s/step {row.get('tokens_per_s') or 0:8.0f} "
                      f"tok/s dev {row.get('peak_device_gib') or float('nan'):.2f} GiB pred "
                      f"{row['predicted_here_gib']:.2f} ({100 * (row.get('planner_error') or float('nan')):+.1f}%) "
                      f"card {row['predicted_gtx1650_gib']:.2f}/{row['gtx1650_budget_gib']:.2f} rc={row['returncode']}",
                      flush=True)
                run_file.write(out)  # after every run: what a deadline or a kill leaves is kept
    print(f"wrote {run_file.write(out)}")


if __name__ == "__main__":
    main()

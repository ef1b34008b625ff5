"""The cards our learners own, as PyTorch sees them: what "fits a GTX 1650" means in numbers.

A 4 GB card is not 4.00 GiB to PyTorch. Linux drivers report about 3.81 GiB of total capacity for a GTX 1650 (newer
drivers 3.6-3.7 GiB for a 4 GB Ampere laptop chip), the CUDA context takes about 0.3 GiB of it, and a screen driven
by the same card keeps a few hundred MiB more. Each preset names those figures with where they were read
(`SOURCES`), so a plan for a card is that card's budget, and the emulation on a bigger GPU caps PyTorch's allocator
where the card would: total - context - desktop reserve.

Each preset also names its compute (16-bit matmul peak at boost clock, memory bandwidth, PCIe), which
nb_helpers.plan.step_time scales the H200's measured times to. Figures not found in a public report are marked as
estimates. Windows reports the full 4.00 GiB but its driver
mode (WDDM) keeps 10-15% back, so the Linux figure is the safer one there too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DESKTOP_RESERVE_GIB = 0.35  # Xorg + gnome-shell on a GTX 1050 Ti laptop: 327 MiB (source "desktop")
CONTEXT_GIB = 0.30  # CUDA 12/13 with lazy loading: "~300MB" (source "context")

SOURCES = {
    "gtx1650": "https://github.com/ultralytics/yolov5/issues/285 (GTX 1650: '3.81 GiB total capacity')",
    "rtx3050-laptop": "https://github.com/Robbyant/lingbot-map/issues/73 (GA107 laptop chip, 2026 driver: 'total "
                      "capacity of 3.68 GiB'); an older driver gave 3.81 GiB (https://github.com/NVlabs/RVT/issues/7)",
    "t4": "https://github.com/NUS-HPC-AI-Lab/VideoSys/issues/192 (Colab T4: 'total capacity of 14.75 GiB')",
    "estimate-6gb": "estimate: other 6 GB cards report 5.80-5.81 GiB on Linux; none found for the RTX 3050 6 GB",
    "estimate-8gb": "estimate: other 8 GB Ampere cards report 7.76-7.79 GiB on Linux; none found for the RTX 3050 8 GB",
    "capability": "https://developer.nvidia.com/cuda-gpus (Turing GTX 16xx and T4: 7.5; Ampere RTX 30xx: 8.6)",
    "context": "https://github.com/pytorch/pytorch/issues/107667 (a PyTorch maintainer: the context is '~300MB' "
               "since CUDA 11.7's lazy loading)",
    "desktop": "https://github.com/pop-os/system76-power/issues/76 (GNOME on Xorg: 327 MiB on a 4 GB laptop card)",
    # compute: the 16-bit matmul peak (fp32 accumulate) at the boost clock, memory bandwidth, PCIe for offloaded copies
    "gtx1650-compute": "https://cputronic.com/gpu/nvidia-geforce-gtx-1650 (896 cores, boost 1665 MHz: 2 x 896 x "
                       "1.665 GHz = 2.98 TFLOPS fp32) and https://informatyk-szczecin.com/pt/placa-grafica-geforce-"
                       "gtx-1650 (14 SMs, 128 GB/s); TU117 has no tensor cores, and PyTorch's fp16 matmul accumulates "
                       "in fp32 (cuBLAS compute type 32F), which runs at the fp32 rate: 2.98 TFLOPS. The 5.97 TFLOPS "
                       "'fp16' of spec sheets is half2 arithmetic with fp16 accumulation, which PyTorch does not use "
                       "for matmuls; PCIe 3.0 x16",
    "gtx1650-laptop-compute": "estimate: the mobile TU117 has 16 SMs / 1024 cores (informatyk-szczecin.com, as above) "
                              "at about 1.5 GHz under a laptop's power limit: 2 x 1024 x 1.5 GHz = ~3.1 TFLOPS at the "
                              "fp32 rate PyTorch's fp16 matmuls run at there (see gtx1650-compute); 128 GB/s (GDDR5)",
    "rtx3050-laptop-compute": "https://hmc-tech.com/gpu/nvidia-geforce-rtx-2050-vs-nvidia-geforce-rtx-3050-laptop-80w "
                              "(RTX 3050 Laptop 80 W: 14.25 TFLOPS BF16 tensor, dense; 35-45 W versions clock lower); "
                              "128-bit GDDR6 at 12 Gbps: 192 GB/s; PCIe 4.0 x8",
    "rtx3050-desktop-compute": "https://www.hardwaredb.net/geforce-rtx-3050-benchmark (8 GB: 2560 cores, boost 1777 MHz, "
                               "224 GB/s); GeForce Ampere runs BF16 tensor math (fp32 accumulate) at twice its fp32 rate "
                               "(GA102 whitepaper, https://docslib.org/doc/759549/nvidia-ampere-ga102-gpu-architecture"
                               "-whitepaper): 18.2 TFLOPS; the 6 GB card (2304 cores, 1470 MHz, 168 GB/s) estimated so",
    "t4-compute": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-"
                  "951643.pdf (65 TFLOPS fp16 mixed precision, 320 GB/s); it clocks down under its 70 W limit",
}


@dataclass(frozen=True)
class Card:
    key: str
    name: str
    total_gib: float  # torch.cuda.get_device_properties(0).total_memory / 2**30 on Linux
    capability: tuple[int, int]  # decides the dtype (bf16 needs >= 8.0) and the cuBLAS workspaces
    source: str  # a key of SOURCES for total_gib
    context_gib: float = CONTEXT_GIB
    desktop_gib: float = DESKTOP_RESERVE_GIB  # 0 where no screen can hang off the card (a T4)
    tflops16: float = 2.98  # 16-bit matmul peak (fp32 accumulate) at the boost clock: the time model's compute
    bandwidth_gbs: float = 128.0  # memory bandwidth: the time model's bytes
    pcie_gbs: float = 12.0  # host <-> card copies (offloaded checkpoints); PCIe 3.0 x16 or 4.0 x8, in practice
    compute_source: str = "gtx1650-compute"
    device_names: tuple[str, ...] = ("GTX 1650",)  # in torch.cuda.get_device_name() when this card is the GPU itself

    def compute(self) -> dict:
        """The peaks nb_helpers.plan.step_time scales the H200's measured times to."""
        return dict(name=self.name, tflops16=self.tflops16, bandwidth_gbs=self.bandwidth_gbs, pcie_gbs=self.pcie_gbs,
                    device_names=self.device_names)

    def reserve_gib(self, desktop: bool) -> float:
        return self.desktop_gib if desktop else 0.0

    def budget_gib(self, desktop: bool = True) -> float:
        """What a run may use, CUDA context included (the planner's and budget_gib's meaning)."""
        return round(self.total_gib - self.reserve_gib(desktop), 2)

    def allocator_cap_gib(self, desktop: bool = True) -> float:
        """PyTorch's share on the card: what the emulation on a bigger GPU caps the allocator at."""
        return round(self.budget_gib(desktop) - self.context_gib, 2)

    def describe(self, desktop: bool = True) -> str:
        reserve = f" - desktop {self.desktop_gib:.2f}" if desktop and self.desktop_gib else ""
        return (f"{self.name}: {self.total_gib:.2f} GiB as PyTorch reports it{reserve} = budget "
                f"{self.budget_gib(desktop):.2f} GiB (context {self.context_gib:.2f} + PyTorch "
                f"{self.allocator_cap_gib(desktop):.2f}), compute capability {self.capability[0]}.{self.capability[1]}")


CARDS = {card.key: card for card in (
    Card("gtx1650", "GTX 1650 (4 GB)", 3.81, (7, 5), "gtx1650"),
    Card("gtx1650-laptop", "GTX 1650 laptop / 1650 Ti (4 GB)", 3.81, (7, 5), "gtx1650", tflops16=3.1,
         compute_source="gtx1650-laptop-compute"),
    Card("rtx3050-laptop-4gb", "RTX 3050 laptop (4 GB)", 3.68, (8, 6), "rtx3050-laptop", tflops16=14.25,
         bandwidth_gbs=192.0, compute_source="rtx3050-laptop-compute", device_names=("RTX 3050",)),
    Card("rtx3050-6gb", "RTX 3050 6 GB", 5.80, (8, 6), "estimate-6gb", tflops16=13.5, bandwidth_gbs=168.0,
         compute_source="rtx3050-desktop-compute", device_names=("RTX 3050",)),
    Card("rtx3050-8gb", "RTX 3050 8 GB", 7.78, (8, 6), "estimate-8gb", tflops16=18.2, bandwidth_gbs=224.0,
         compute_source="rtx3050-desktop-compute", device_names=("RTX 3050",)),
    Card("t4", "Tesla T4 16 GB (Colab)", 14.75, (7, 5), "t4", desktop_gib=0.0, tflops16=65.0, bandwidth_gbs=320.0,
         compute_source="t4-compute", device_names=("T4",)),
)}
GENERIC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*gi?b\s*$", re.IGNORECASE)


def card_names() -> list[str]:
    return [*CARDS, "<N> GiB (e.g. '6 GiB': any card, compute capability 7.5 assumed)"]


def find_card(name: str) -> Card:
    """A preset by key (`gtx1650`), or a generic '<N> GiB' card: N GiB total, Turing's capability and a GTX 1650's
    speed (the course's most conservative: fp16, no bf16), the usual context and desktop reserve."""
    if name in CARDS:
        return CARDS[name]
    generic = GENERIC.match(name)
    if generic and 1.0 <= float(generic.group(1)) <= 200.0:
        total = float(generic.group(1))
        return Card(name.strip(), f"a {total:g} GiB card", total, (7, 5), "generic: the size given",
                    compute_source="gtx1650-compute", device_names=())  # the GTX 1650's speed: the slowest card the course targets
    raise ValueError(f"card={name!r}: not a preset; choose one of {', '.join(CARDS)}, or '<N> GiB' (e.g. '6 GiB')")


# --- a run's card -----------------------------------------------------------------------------------------------
COURSE_CARD = "gtx1650"  # the card the course targets when nothing else is said (plans, notebook 02, warnings)


def run_card(cfg) -> Card | None:
    """The card a RunConfig names (cfg.card), else None."""
    return find_card(cfg.card) if cfg.card else None


def budget_of(cfg, course_card: bool = False) -> float | None:
    """GiB a run may use, CUDA context included: budget_gib as set, else its card's budget, else (`course_card`)
    the course's GTX 1650, else None (no cap). The one place a budget comes from."""
    if cfg.budget_gib is not None:
        return cfg.budget_gib
    card = run_card(cfg) or (find_card(COURSE_CARD) if course_card else None)
    return card.budget_gib(cfg.desktop_on_card) if card else None


def machine_budget_gib(cfg, gpu_total_gib: float | None) -> float | None:
    """The budget auto-fit and the panel both judge against on a machine whose GPU has `gpu_total_gib` (None: no
    GPU): budget_of(cfg) where one is set or a card is named, else that GPU's own total less the desktop reserve, as
    a card preset counts it (cfg.desktop_on_card=False on a headless machine), else None."""
    named = budget_of(cfg)
    if named is not None or gpu_total_gib is None:
        return named
    return round(gpu_total_gib - (DESKTOP_RESERVE_GIB if cfg.desktop_on_card else 0.0), 2)


def warn_line_gib(cfg) -> float:
    """Where notebook 04 flags device memory: vram_warn_gib as set, else the budget of the run's card (the course's
    GTX 1650: 3.46 GiB, below its 3.81 GiB total, so the flag can come before an out-of-memory error)."""
    return cfg.vram_warn_gib if cfg.vram_warn_gib is not None else budget_of(cfg, course_card=True)


def planning_context_gib(cfg, measured_gib: float | None) -> float | None:
    """The context a plan counts: the card's, when the run emulates one (the emulation caps PyTorch where the card
    would, whatever this GPU's own context), else the one measured here."""
    card = run_card(cfg)
    return card.context_gib if card is not None else measured_gib

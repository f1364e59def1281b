"""Where metrics go: a progress bar, ``metrics.jsonl``, TensorBoard and (when configured) W&B.

Only process 0 writes. MFU is model FLOPs per second over the devices' peak dense bf16 FLOP/s, from the
table below (datasheet figures, no sparsity); device kinds not in the table report no MFU rather than a guess.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import LoggingConfig

# Peak dense bf16 FLOP/s per device, from vendor datasheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # Trillium / v6e
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100": 312e12,
}


def peak_flops(device: Any) -> float | None:
    kind = getattr(device, "device_kind", "")
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind]
    matches = [v for k, v in PEAK_FLOPS.items() if kind.startswith(k)]
    return matches[0] if matches else None


class MetricsWriter:
    """Writes scalars for a step to every configured sink (process 0 only)."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int, config: dict[str, Any]):
        self.enabled = jax.process_index() == 0
        self.bar = self.jsonl = self.tb = self.wandb = None
        if not self.enabled:
            return
        if cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if cfg.jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb_project is set but wandb is not installed: pip install 'jaxtune[wandb]'") from None
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=config, resume="allow")

    def write(self, step: int, scalars: dict[str, float], kind: str = "train") -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, "kind": kind, "time": time.time(), **scalars}) + "\n")
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(f"{kind}/{k}", v, step)
        if self.wandb:
            self.wandb.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)
        if self.bar and kind == "train":
            shown = {k: scalars[k] for k in ("loss", "lr", "tok_s") if k in scalars}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for sink in (self.bar, self.jsonl, self.tb):
            if sink:
                sink.close()
        if self.wandb:
            self.wandb.finish()


def plot_loss(metrics_path: Path, out: Path) -> Path | None:
    """Loss curve (train and validation) from metrics.jsonl as a PNG."""
    if not metrics_path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        pts = sorted({r["step"]: r["loss"] for r in rows if r.get("kind") == kind and "loss" in r}.items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

"""``jaxtune parity HF_DIR``: is the native model the checkpoint's model? Run it before a long job.

Loads the checkpoint natively and in `transformers` (CPU, float32, eager attention), runs the same batch
through both, and compares: logits (relative error max|ours - theirs| / max|theirs| and mean|diff| /
mean|theirs|) and greedy generation (our KV-cache generator against ``transformers.generate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, including "
    "both the natural and social sciences. Science is a body of empirical, theoretical, and practical knowledge "
    "about the natural world, produced by scientists who emphasize the observation, explanation, and prediction "
    "of real-world phenomena. The earliest roots of science can be traced to Ancient Egypt and Mesopotamia."
)


@dataclass
class ParityReport:
    family: str
    max_rel: float
    mean_rel: float
    greedy_agree: list[int] = field(default_factory=list)  # matching leading tokens, per prompt
    new_tokens: int = 0
    tolerance: float = 1e-4
    text_source: str = "random ids"

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance and all(a == self.new_tokens for a in self.greedy_agree)

    def format(self) -> str:
        agree = ", ".join(f"{a}/{self.new_tokens}" for a in self.greedy_agree)
        return "\n".join([
            f"family:                 {self.family}",
            f"batch:                  {self.text_source}",
            f"logits max rel. error:  {self.max_rel:.3e}  (max|ours - transformers| / max|transformers|; "
            f"tolerance {self.tolerance:g})",
            f"logits mean rel. error: {self.mean_rel:.3e}  (mean|ours - transformers| / mean|transformers|)",
            f"greedy agreement:       {agree}  (leading generated tokens equal, per prompt)",
            f"result:                 {'PASS' if self.ok else 'FAIL'}",
        ])


def _batch(directory: Path, vocab: int, batch: int, seq: int, seed: int) -> tuple[np.ndarray, str]:
    """Real text through the checkpoint's tokenizer when it has one, else seeded random ids."""
    if (directory / "tokenizer.json").is_file():
        from jaxtune.data.tokenizer import _load_hf

        tok = _load_hf(str(directory))
        ids = tok.encode(SAMPLE_TEXT)
        if len(ids) >= seq + batch and max(ids) < vocab:
            return np.stack([ids[i:i + seq] for i in range(batch)]).astype(np.int32), "tokenized sample text"
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int32), "random ids"


def parity(directory: str | Path, *, batch: int = 2, seq: int = 32, new_tokens: int = 32, tolerance: float = 1e-4,
           seed: int = 0) -> ParityReport:
    import jax.numpy as jnp
    from flax import nnx

    try:
        import torch
        import transformers
    except ImportError:
        raise ImportError("jaxtune parity runs the checkpoint in transformers too: pip install 'jaxtune[hf,torch]'")

    from jaxtune.generate import Generator
    from jaxtune.models.hf import from_hf, read_hf_config

    directory = Path(directory).expanduser()
    fam, cfg, _ = read_hf_config(directory)
    native = from_hf(directory, param_dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                               attn_implementation="eager")
    theirs.eval()
    tokens, source = _batch(directory, cfg.vocab_size, batch, seq, seed)
    ours = np.asarray(native(jnp.asarray(tokens)))
    with torch.no_grad():
        ref = theirs(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    diff = np.abs(ours - ref)
    report = ParityReport(fam.name, float(diff.max() / np.abs(ref).max()), float(diff.mean() / np.abs(ref).mean()),
                          new_tokens=new_tokens, tolerance=tolerance, text_source=source)
    if new_tokens:
        graphdef, state = nnx.split(native, nnx.Param)
        prompts = [list(map(int, row[: seq // 2 + i])) for i, row in enumerate(tokens)]  # different lengths
        gen = Generator(graphdef, cfg.max_seq_len)(nnx.to_pure_dict(state), prompts, max_new_tokens=new_tokens)
        greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                               pad_token_id=0)
        for p, mine in zip(prompts, gen):
            with torch.no_grad():
                out = theirs.generate(torch.tensor([p]), generation_config=greedy, attention_mask=torch.ones(1, len(p),
                                      dtype=torch.long))
            hf_ids = out[0, len(p):].tolist()
            agree = next((i for i, (a, b) in enumerate(zip(mine, hf_ids)) if a != b), min(len(mine), len(hf_ids)))
            report.greedy_agree.append(agree)
    return report

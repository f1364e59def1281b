"""``jaxtune parity HF_DIR [--backend torchax]``: is jaxtune's model the checkpoint's model? Run it before a long
job.

Loads the checkpoint in jaxtune and in `transformers` (CPU, float32, eager attention), runs the same batch
through both, and compares: logits (relative error max|ours - theirs| / max|theirs| and mean|diff| /
mean|theirs|) and greedy generation (our generator against ``transformers.generate``). With the torchax backend
the transformers model run through torchax is compared too (and the native model, when the family has one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxtune.backends import BACKENDS
from jaxtune.data import load_hf_tokenizer
from jaxtune.io import CheckpointError
from jaxtune.models.hf import HFCheckpoint, read_config_json, read_hf_config

SAMPLE_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, including "
    "both the natural and social sciences. Science is a body of empirical, theoretical, and practical knowledge "
    "about the natural world, produced by scientists who emphasize the observation, explanation, and prediction "
    "of real-world phenomena. The earliest roots of science can be traced to Ancient Egypt and Mesopotamia."
)


@dataclass
class Comparison:
    """One model's logits against transformers' eager PyTorch on the same batch."""

    name: str  # "native" / "torchax"
    max_rel: float
    mean_rel: float
    greedy_agree: list[int] = field(default_factory=list)  # matching leading generated tokens, per prompt


@dataclass
class ParityReport:
    family: str
    comparisons: list[Comparison]
    new_tokens: int = 0
    tolerance: float = 1e-4
    text_source: str = "random ids"

    @property
    def ok(self) -> bool:
        return all(c.max_rel <= self.tolerance and all(a == self.new_tokens for a in c.greedy_agree)
                   for c in self.comparisons)

    def format(self) -> str:
        lines = [f"family:                 {self.family}", f"batch:                  {self.text_source}"]
        for c in self.comparisons:
            agree = ", ".join(f"{a}/{self.new_tokens}" for a in c.greedy_agree) or "not run"
            lines += [
                f"[{c.name} vs transformers eager]",
                f"  logits max rel. error:  {c.max_rel:.3e}  (max|ours - transformers| / max|transformers|; "
                f"tolerance {self.tolerance:g})",
                f"  logits mean rel. error: {c.mean_rel:.3e}  (mean|ours - transformers| / mean|transformers|)",
                f"  greedy agreement:       {agree}  (leading generated tokens equal, per prompt)",
            ]
        lines.append(f"result:                 {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def _batch(directory: Path, vocab: int, batch: int, seq: int, seed: int) -> tuple[np.ndarray, str]:
    """Real text through the checkpoint's tokenizer when it has one, else seeded random ids."""
    if (directory / "tokenizer.json").is_file():
        tok = load_hf_tokenizer(str(directory))
        ids = tok.encode(SAMPLE_TEXT)
        if len(ids) >= seq + batch and max(ids) < vocab:
            return np.stack([ids[i:i + seq] for i in range(batch)]).astype(np.int32), "tokenized sample text"
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int32), "random ids"


def parity(directory: str | Path, *, batch: int = 2, seq: int = 32, new_tokens: int = 32, tolerance: float = 1e-4,
           seed: int = 0, backend: str = "native") -> ParityReport:
    """Compare the checkpoint's model in jaxtune with transformers (eager attention, float32) on one batch.

    ``backend="native"``: jaxtune's Flax model. ``"torchax"``: the transformers model itself run through
    torchax, and also the native model when the family has one (native vs torchax vs PyTorch eager)."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ImportError("jaxtune parity runs the checkpoint in transformers too: pip install 'jaxtune[hf,torch]'")

    # The check `jaxtune train` and `eval` make before loading: config.json readable, every safetensors file named
    # and complete (a one-line CheckpointError naming the file, not transformers' traceback).
    directory = HFCheckpoint(directory).dir
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                   attn_implementation="eager", use_safetensors=True)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: transformers cannot load it: {' '.join(str(e).split())}") from None
    theirs.eval()
    vocab = theirs.get_input_embeddings().num_embeddings
    tokens, source = _batch(directory, vocab, batch, seq, seed)
    with torch.no_grad():
        ref = theirs(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    prompts = [list(map(int, row[: seq // 2 + i])) for i, row in enumerate(tokens)]  # different lengths
    hf_greedy = _hf_greedy(theirs, prompts, new_tokens) if new_tokens else []
    native = BACKENDS["native"].runs(read_config_json(directory))
    if backend == "native" and not native:
        read_hf_config(directory)  # raises UnsupportedModelError, saying why and what to do
    family = read_hf_config(directory)[0].name if native else theirs.config.model_type
    names = (["native"] if native else []) + (["torchax"] if backend == "torchax" else [])
    runs = [(name, *BACKENDS[name].parity_model(directory)) for name in names]
    comparisons = []
    for name, logits_fn, generate in runs:
        ours = np.asarray(logits_fn(tokens))
        diff = np.abs(ours - ref)
        c = Comparison(name, float(diff.max() / np.abs(ref).max()), float(diff.mean() / np.abs(ref).mean()))
        if new_tokens:
            for mine, hf_ids in zip(generate(prompts, new_tokens), hf_greedy):
                c.greedy_agree.append(next((i for i, (a, b) in enumerate(zip(mine, hf_ids)) if a != b),
                                           min(len(mine), len(hf_ids))))
        comparisons.append(c)
    return ParityReport(family, comparisons, new_tokens=new_tokens, tolerance=tolerance, text_source=source)


def _hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    import transformers

    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0)
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), generation_config=greedy,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(ids[0, len(p):].tolist())
    return out

"""``jaxtune parity HF_DIR [--backend torchax]``: is jaxtune's model the checkpoint's model? Run it before a long
job.

Loads the checkpoint in jaxtune and in `transformers` (CPU, float32, eager attention), runs the same batch
through both, and compares: logits (relative error max|ours - theirs| / max|theirs| and mean|diff| /
mean|theirs|) and greedy generation (our generator against ``transformers.generate``). With the torchax backend
the transformers model run through torchax is compared too (and the native model, when the family has one).

Greedy generation follows one stopping rule on both sides: the checkpoint's EOS ids (generation_config.json, else
config.json; transformers stops at them whatever it is told). Each prompt's tokens are compared up to and including
the first EOS of either side, and the report says where a side stopped, so a real checkpoint that ends its answer
early is not scored as disagreeing.
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
    greedy_compared: list[int] = field(default_factory=list)  # tokens compared: up to the first EOS of either side
    greedy_stops: list[str] = field(default_factory=list)  # where a side stopped at EOS ("" when neither did)


@dataclass
class ParityReport:
    family: str
    comparisons: list[Comparison]
    new_tokens: int = 0
    tolerance: float = 1e-4
    text_source: str = "random ids"

    @property
    def ok(self) -> bool:
        return all(c.max_rel <= self.tolerance and c.greedy_agree == c.greedy_compared for c in self.comparisons)

    def format(self) -> str:
        lines = [f"family:                 {self.family}", f"batch:                  {self.text_source}"]
        for c in self.comparisons:
            agree = ", ".join(f"{a}/{n}" + (f" ({stop})" if stop else "")
                              for a, n, stop in zip(c.greedy_agree, c.greedy_compared, c.greedy_stops)) or "not run"
            lines += [
                f"[{c.name} vs transformers eager]",
                (f"  logits max rel. error:  {c.max_rel:.3e}  (max|ours - transformers| / max|transformers|; "
                 f"tolerance {self.tolerance:g})"),
                f"  logits mean rel. error: {c.mean_rel:.3e}  (mean|ours - transformers| / mean|transformers|)",
                (f"  greedy agreement:       {agree}  (leading generated tokens equal, per prompt, up to the "
                 "first EOS of either side)"),
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
    eos = _eos_ids(directory, theirs)
    hf_greedy = _hf_greedy(theirs, prompts, new_tokens, eos) if new_tokens else []
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
                agree, compared, stop = greedy_agreement(list(mine), hf_ids, eos)
                c.greedy_agree.append(agree)
                c.greedy_compared.append(compared)
                c.greedy_stops.append(stop)
        comparisons.append(c)
    return ParityReport(family, comparisons, new_tokens=new_tokens, tolerance=tolerance, text_source=source)


def greedy_agreement(ours: list[int], theirs: list[int], eos: set[int]) -> tuple[int, int, str]:
    """(leading tokens equal, tokens compared, where a side stopped) for one prompt's greedy continuations: both are
    compared up to and including the first EOS of either side (a side that stops early is not a disagreement when
    the other emits the same EOS there)."""

    def stop(ids: list[int]) -> int | None:
        return next((i + 1 for i, t in enumerate(ids) if t in eos), None)

    ours_stop, theirs_stop = stop(ours), stop(theirs)
    ends = [n for n in (ours_stop, theirs_stop, len(ours), len(theirs)) if n is not None]
    compared = min(ends)
    agree = next((i for i, (a, b) in enumerate(zip(ours[:compared], theirs[:compared])) if a != b), compared)
    if ours_stop == theirs_stop and ours_stop is not None:
        where = f"both stopped at EOS after {ours_stop}"
    else:
        sides = [f"{name} stopped at EOS after {n}" for name, n in (("ours", ours_stop), ("transformers", theirs_stop))
                 if n is not None]
        where = "; ".join(sides)
    return agree, compared, where


def _eos_ids(directory: Path, model) -> set[int]:
    """The EOS ids transformers stops greedy generation at: generation_config.json's, else config.json's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in ([ids] if isinstance(ids, int) else ids)}


def _hf_greedy(model, prompts: list[list[int]], new_tokens: int, eos: set[int]) -> list[list[int]]:
    import torch
    import transformers

    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                           eos_token_id=sorted(eos) or None, pad_token_id=0)
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), generation_config=greedy,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(ids[0, len(p):].tolist())
    return out

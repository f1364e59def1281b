"""GRPO (`jaxtune.train.objectives.grpo`) against TRL 1.16.0's own code, on a tiny random fp32 `LlamaForCausalLM`
saved with ``save_pretrained`` and read by jaxtune (``model.from_hf``), and its passes and micro-batches through the
real train step (`jaxtune.train.step.build_steps`).

The rollout is made by hand: 2 prompts (3 and 9 tokens) x a group of 4 completions (N = 8) of 2 to 12 tokens, each
ending in EOS but one cut at ``max_completion_length`` = 12; made-up rewards, one group's all equal; advantages by TRL's
group normalisation ((r - group mean) / (group std + 1e-4), `trl.trainer.utils.nanstd`), which
`jaxtune.train.objectives.advantages.group_advantages` is checked to reproduce. Both sides get those advantages. Ours
lays the rollout out as the loop does (`jaxtune.rollout.rollout.training_rows`, right-padded rows of prompt then
completion; where a check says so, also `shared_rows`, each prompt once then its completions in regions:
`shared_batch`); TRL's inputs are as ``_generate_and_score_completions`` makes them: ``prompt_ids``/``prompt_mask``
left-padded, ``completion_ids``/``completion_mask`` right-padded (the mask through the EOS, all ones for the cut one),
``advantages`` (B,), ``num_items_in_batch`` (the completion tokens), ``ref_per_token_logps`` when beta > 0 and
``old_per_token_logps`` for the mu > 1 check.

The TRL side is a real `GRPOTrainer` (``GRPOConfig(bf16=False, use_cpu=True, report_to=[])``, its beta, epsilon,
epsilon_high, loss_type, temperature, max_completion_length=12, num_generations=4, per_device_train_batch_size=8, a
two-prompt dataset and a reward function it never calls): ``trainer.compute_loss(trainer.model, inputs)`` (which is
``_compute_loss``) in train mode, its loss, ``loss.backward()``'s gradients and the metrics it logged in
``_metrics["train"]``. ``current_gradient_accumulation_steps``, which `transformers.Trainer` sets only inside its
training loop, is set to 1 (one process, steps_per_generation 1: no rescaling of any loss type). Its reference and
sampling-policy log-probs are TRL's ``_get_per_token_logps_and_entropies`` (the fused, tempered LM head
``GRPOTrainer`` adds) on the reference model (its ``ref_model`` given the unperturbed weights) and on the old
checkpoint. The policy is the saved model plus noise (both sides read the same perturbed checkpoint), the reference
the unperturbed one (so KL != 0), the sampling policy of the mu > 1 check ("old") the policy plus more noise, so some
ratios leave [1 - epsilon, 1 + epsilon_high] on both sides (asserted).

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|, float32 on both sides. Tolerances:
  * loss_type grpo, dapo, dr_grpo, beta = 0: loss and the gradients of the embedding, a q_proj, an mlp down_proj,
    the final norm and lm_head                                                                     rel <= 1e-5
  * dapo, beta = 0.04 (the reference a frozen copy, as full fine-tuning has it): loss, gradients and the ``kl``
    metric vs TRL's logged ``kl``                                                                  rel <= 1e-5
  * temperature 0.7 (dapo, beta = 0.04): loss, gradients and kl                                    rel <= 1e-5
  * mu > 1 (``old_logps`` from the old checkpoint, epsilon 0.2, epsilon_high 0.28): loss, gradients and the
    clip_ratio/low_mean, high_mean and region_mean metrics vs TRL's logged ones (all > 0)          rel <= 1e-5
  * dapo, beta = 0.04, with ``old_logps``: loss and gradients (the KL term weighted by the ratio, TRL's
    use_bias_correction_kl)                                                                        rel <= 1e-5
    and the ``kl`` metric vs TRL's logged one (both the ratio-weighted mean the loss adds)          rel <= 1e-5
  * importance_sampling_level sequence (grpo with and without beta, cispo, off-policy; dapo on-policy), in rows and
    shared-prompt rows: loss, gradients, the clip ratios (per completion) and kl                  rel <= 1e-5
  * sequence_token vs the GSPO-token formula written out in the test (jaxtune on both sides): loss and every
    gradient leaf; its loss and metrics vs sequence's                                              rel <= 1e-5
  * sapo (on- and off-policy, with beta, other temperatures, a sequence ratio), rows and shared-prompt rows: loss,
    gradients and kl                                                                               rel <= 1e-5
  * luspo (a sequence ratio on- and off-policy, with beta; token ratios), rows and shared-prompt rows: loss,
    gradients, clip ratios and kl                                                                  rel <= 1e-5
  * vespo (on- and off-policy, with beta, other k and lambda; rows and shared-prompt rows; token_truncate and
    token_mask sampler weights): loss, gradients, vespo/phi_seq_mean and kl                       rel <= 1e-5
  * bnpo vs TRL's bnpo on one micro-batch (on- and off-policy): loss, gradients, clip ratios       rel <= 1e-5
    and vs our dapo                                                                                bitwise
  * off_policy_mask_threshold (OPSM; dapo, grpo with beta; rows and shared-prompt rows): loss, gradients, clip
    ratios and kl                                                                                  rel <= 1e-5
  * top_entropy_quantile (dapo, grpo with beta, vespo) and entropy_coef (dapo, grpo with a quantile, dr_grpo), on
    one micro-batch, rows and shared-prompt rows: loss, gradients, entropy, policy_loss, entropy_coef and the
    loss type's metrics                                                                            rel <= 1e-5
  * the entropy from chunked log-probs vs from the whole logits                                    rel <= 1e-6
  * the train step with entropy_coef (dapo) in 2 micro-batches vs 1: loss, entropy metrics, update rel <= 1e-6
  * the train step (dapo, with ``old_logps``) in 2 micro-batches of different token counts vs 1: loss, metrics, and
    every parameter's update                                                                       rel <= 1e-6
  * objective.num_iterations=2 through the train step: `GRPO.prepare` called once, 2 AdamW updates, every
    parameter's update equal to that of two made by hand (the spec's optimizer, ``old_logps`` fixed at the first
    weights'), and unlike that with ``old_logps`` re-taken before the second (rel 0.5 here)        rel <= 1e-6
  The updates' errors are measured against the update, beyond one float32 spacing of the parameter per update
  applied (`update_error`): the parameters are float32, and an update of 1e-3 to a norm scale near 1 is only
  resolved to 6e-8 / 1e-3 = 6e-5. The spec's AdamW has eps = 0.1: at the default 1e-8 its first update is
  lr * g / (|g| + 1e-8), which a float32 rounding of a gradient entry near 1e-8 moves by a good part of lr.

XLA's CPU compiles dominate the run time, so one spec serves every check (the objective is not part of a spec), each
objective's loss-and-gradient function is compiled once and, like the train steps, without LLVM's optimisations
(``xla_backend_optimization_level=0``: the same operations, compiled in a third of the time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import trl_reference
from helpers.compare import rel
from helpers.trl_reference import BOS, EOS, MESH, PAD, TOL, TRL_VERSION, Native, Ours, TRLResult, hf_model

from jaxtune import sharding
from jaxtune.config import ObjectiveConfig, TrainConfig, load_config, objective_config
from jaxtune.config.kinds import SAMPLER_LOGPS_KEY
from jaxtune.rollout.rollout import shared_rows, training_rows
from jaxtune.train.objectives import GRPO, RLOO, Reference, make_objective
from jaxtune.train.objectives.advantages import Rewarded, group_advantages, leave_one_out_advantages
from jaxtune.train.objectives.grpo import LAST_ENTROPY
from jaxtune.train.objectives.reinforce_pp import ReinforcePP
from jaxtune.train.step import build_steps, per_unit

torch = pytest.importorskip("torch", reason="the TRL comparisons run PyTorch")
trl = pytest.importorskip("trl", reason="GRPO is checked against TRL's code")
datasets = pytest.importorskip("datasets", reason="GRPOTrainer takes a datasets.Dataset")

STEP_TOL = 1e-6  # the train step against the same objective by hand (TOL, 1e-5: against TRL)
V, T = 128, 24  # vocabulary; positions per row (the longest rollout needs 9 + 12 - 1 = 20)
MAX_COMPLETION = 12
GROUP = 4
PROMPTS = [[BOS, 5, 9], [BOS, 10, 11, 12, 13, 14, 15, 16, 17]]
# GROUP completions of each prompt, contiguous: 2 to 12 tokens, all ending in EOS but the 4th (cut at 12).
COMPLETIONS = [
    [20, 21, EOS], [22, EOS], [23, 24, 25, 26, 27, 28, 29, EOS], list(range(30, 42)),
    [50, 51, 52, 53, EOS], [54, 55, EOS], [56, 57, 58, 59, 60, 61, 62, 63, 64, 65, EOS], [66, 67, 68, 69, 70, 71, EOS],
]
REWARDS = [1.0, 0.0, 0.5, -0.5, 0.5, 0.5, 0.5, 0.5]  # the second group's all equal: advantages 0
N = len(COMPLETIONS)
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
OFF_POLICY = {"epsilon": 0.2, "epsilon_high": 0.28}  # the mu > 1 checks' clipping (DAPO's clip-higher)
# A sequence's ratio (the geometric mean of its tokens') moves less than its tokens': a narrower clip, which some of the
# old checkpoint's completions leave
SEQUENCE_CLIP = {"epsilon": 0.02, "epsilon_high": 0.02}


def update_error(new, ref_new, start, ulps: int = 1) -> float:
    """How far parameters ``new`` are from ``ref_new``, both reached from ``start``, relative to the update: per
    leaf max(|new - ref_new| - ulps float32 spacings of the parameter, 0) / max|ref_new - start|, the worst leaf. An
    update equal to 1e-6 can still land on the neighbouring float32 of the parameter (for a norm scale near 1, 6e-8:
    6e-5 of a 1e-3 update), once per update applied."""

    def leaf(a, b, s):
        a, b, s = np.asarray(a), np.asarray(b), np.asarray(s)
        excess = np.abs(a.astype(np.float64) - b) - ulps * np.spacing(np.maximum(np.abs(a), np.abs(b)))
        return float(np.maximum(excess, 0.0).max() / np.abs(b.astype(np.float64) - s).max())

    return max(jax.tree.leaves(jax.tree.map(leaf, new, ref_new, start)))


def prompt_of(i: int) -> list[int]:
    return PROMPTS[i // GROUP]


# ---------------------------------------------------------------------------------------------------- checkpoints


# One PyTorch thread while this module runs (see trl_reference.one_torch_thread).
torch_one_thread = pytest.fixture(scope="module", autouse=True)(trl_reference.one_torch_thread)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"ref": a random tiny Llama, "policy": the same plus noise, "old": the policy plus more noise}, each a
    save_pretrained directory."""
    return trl_reference.save_checkpoints(tmp_path_factory.mktemp("grpo"), V, {"policy": 0.05, "old": 0.1})


# ---------------------------------------------------------------------------------------------------- the rollout


def trl_advantages() -> np.ndarray:
    """(N,) float32: TRL's group normalisation of REWARDS (``_generate_and_score_completions``, scale_rewards
    "group")."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor(REWARDS, dtype=torch.float32)
    mean = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    std = nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    return ((rewards - mean) / (std + 1e-4)).numpy()


ADVANTAGES = trl_advantages()


def our_batch(old_logps: np.ndarray | None = None, sampler_logps: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The rollout as the loop lays it out: (N, T) rows, ``advantages``, and (N, T) ``old_logps`` when given; the
    sampler's log-probs ``sampler_logps`` (N, T) when given, else 0 (no test below corrects with those)."""
    sampled = [[0.0] * len(c) for c in COMPLETIONS]
    batch = {**training_rows([prompt_of(i) for i in range(N)], COMPLETIONS, sampled, T), "advantages": ADVANTAGES}
    if sampler_logps is not None:
        batch[SAMPLER_LOGPS_KEY] = sampler_logps
    return batch if old_logps is None else {**batch, "old_logps": old_logps}


def shared_batch(old_logps: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The rollout as shared-prompt rows, as the loop lays it out by default (`shared_rows`: each prompt once, then
    its GROUP completions in MAX_COMPLETION slots each), advantages (prompts, GROUP); ``old_logps`` (N, T), in
    our_batch's rows, moved to the completions' slots."""
    prompt_ids = [prompt_of(i) for i in range(N)]
    lay = lambda values: shared_rows(prompt_ids, COMPLETIONS, values, GROUP, T, MAX_COMPLETION)
    batch = {**lay([[0.0] * len(c) for c in COMPLETIONS]), "advantages": ADVANTAGES.reshape(-1, GROUP)}
    if old_logps is None:
        return batch
    starts = [len(prompt_of(i)) - 1 for i in range(N)]
    moved = [old_logps[i, s:s + len(c)].tolist() for i, (s, c) in enumerate(zip(starts, COMPLETIONS))]
    return {**batch, "old_logps": lay(moved)[SAMPLER_LOGPS_KEY]}


def completion_to_rows(x: torch.Tensor) -> np.ndarray:
    """TRL's (N, 12) per-completion-token values at our rows' target positions (N, T), 0 elsewhere."""
    out = np.zeros((N, T), np.float32)
    for i, c in enumerate(COMPLETIONS):
        start = len(prompt_of(i)) - 1
        out[i, start:start + len(c)] = x[i, :len(c)].numpy()
    return out


# Multi-turn rollouts (`jaxtune.rollout.agent`): 1 on the model's tokens, 0 on a tool result's inside the completion.
TOOL_MASK = [[1] * len(c) for c in COMPLETIONS]
TOOL_MASK[2][2:5] = [0, 0, 0]
TOOL_MASK[3][1:4] = [0, 0, 0]
TOOL_MASK[6][3:7] = [0, 0, 0, 0]


def trl_inputs(tool_mask: bool = False) -> dict[str, torch.Tensor]:
    """The rollout as TRL's ``_compute_loss`` takes it; ``tool_mask``: with TOOL_MASK as its ``tool_mask``, and
    ``num_items_in_batch`` the model's tokens only, as ``_generate_and_score_completions`` counts them."""
    width = max(map(len, PROMPTS))
    prompt_ids = torch.full((N, width), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((N, width), dtype=torch.long)
    completion_ids = torch.full((N, MAX_COMPLETION), PAD, dtype=torch.long)
    completion_mask = torch.zeros((N, MAX_COMPLETION), dtype=torch.long)
    for i, c in enumerate(COMPLETIONS):
        p = prompt_of(i)
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
        completion_ids[i, :len(c)] = torch.tensor(c)
        completion_mask[i, :len(c)] = 1
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "advantages": torch.tensor(ADVANTAGES),
           "num_items_in_batch": completion_mask.sum()}
    if tool_mask:
        out["tool_mask"] = torch.ones((N, MAX_COMPLETION), dtype=torch.long)
        for i, m in enumerate(TOOL_MASK):
            out["tool_mask"][i, :len(m)] = torch.tensor(m)
        out["num_items_in_batch"] = (completion_mask * out["tool_mask"]).sum()
    return out


def test_rollout_layout():
    """The rollout is what the checks below claim: completion lengths 2 to 12, one cut without EOS, the second
    group's advantages 0, jaxtune's group_advantages equal to TRL's normalisation, and our loss mask on exactly the
    completion tokens TRL's completion_mask marks."""
    lengths = [len(c) for c in COMPLETIONS]
    assert min(lengths) == 2 and max(lengths) == MAX_COMPLETION
    assert sum(c[-1] != EOS for c in COMPLETIONS) == 1
    assert np.all(ADVANTAGES[GROUP:] == 0) and np.all(ADVANTAGES[:GROUP] != 0)
    assert rel(group_advantages(np.array(REWARDS), GROUP, True)[0], ADVANTAGES) <= 1e-6
    batch, inputs = our_batch(), trl_inputs()
    assert np.array_equal(batch["loss_mask"], completion_to_rows(inputs["completion_mask"].float()))
    assert np.array_equal(batch["targets"] * batch["loss_mask"], completion_to_rows(inputs["completion_ids"].float()))
    # The 2 micro-batches (every other row) hold different numbers of completion tokens.
    assert batch["loss_mask"][0::2].sum() != batch["loss_mask"][1::2].sum()


# ---------------------------------------------------------------------------------------------------- TRL side


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer (w3 .. w127): GRPOTrainer needs one; the compared rollouts are token ids."""
    return trl_reference.word_tokenizer(V)


@dataclass
class GRPOResult(TRLResult):
    old_logps: np.ndarray | None = None  # (N, T): the old checkpoint's log-probs given to TRL, in our rows
    sampler_logps: np.ndarray | None = None  # (N, T): the "vLLM" log-probs TRL's importance sampling corrected for


def trl_logps(trainer, model, inputs) -> torch.Tensor:
    """(N, 12) completion-token log-probs of ``model`` by TRL's ``_get_per_token_logps_and_entropies``."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1))[0]


def trl_importance_ratio(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, mode: str,
                         clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """The importance-sampling ratio GRPOTrainer's ``_generate_and_score_completions`` hands its loss when vLLM
    sampled (TRL 1.16, ``vllm_importance_sampling_mode``), from the trainer's ``old`` and the sampler's log-probs;
    except that a sequence's log-ratio is the mean over its tokens, where TRL 1.16 sums them (its issue #5814: the
    sum's spread grows with the length; jaxtune takes the mean, GSPO's geometric mean ratio)."""
    diff = (old - sampled) * mask
    mean = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(mean if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def trl_grpo(checkpoints, tokenizer, tmp_path, off_policy: bool = False, importance: dict | None = None,
             calls: int = 1, tool_mask: bool = False, **config) -> GRPOResult | list[GRPOResult]:
    """GRPOTrainer (the perturbed policy; with beta > 0 its reference model the unperturbed checkpoint):
    ``compute_loss`` on the rollout, the metrics it logged, the policy's gradients. ``off_policy``: the inputs carry
    ``old_per_token_logps`` from the old checkpoint (what TRL holds when num_iterations > 1). ``importance``
    ({mode, clip_min, clip_max}): the old checkpoint's log-probs play the sampler's (vLLM's), corrected as TRL's
    ``vllm_importance_sampling_correction`` does. ``calls`` > 1: ``compute_loss`` that many times on the same weights
    and inputs (each an optimizer-step boundary: adaptive entropy control moves its weight), a result each."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    assert trl.__version__ == TRL_VERSION, f"these comparisons were written against TRL {TRL_VERSION}"
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=N, num_generations=GROUP, max_completion_length=MAX_COMPLETION,
                      num_iterations=2 if off_policy else 1, **config)
    data = datasets.Dataset.from_dict({"prompt": ["w5 w9", "w10 w11"]})
    trainer = GRPOTrainer(model=hf_model(checkpoints["policy"]), reward_funcs=lambda completions, **_: [0.0] * len(
        completions), args=args, train_dataset=data, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which is not run here
    trainer.model.train()  # _compute_loss logs under "train" in train mode (dropout is 0 either way)
    inputs = trl_inputs(tool_mask)
    if args.beta > 0:
        # TRL's default: the KL term is weighted by the ratio
        assert args.use_bias_correction_kl or "use_bias_correction_kl" in config
        # GRPOTrainer loads its reference from the policy's path; give it the unperturbed weights.
        trainer.ref_model.load_state_dict(hf_model(checkpoints["ref"]).state_dict())
        inputs["ref_per_token_logps"] = trl_logps(trainer, trainer.ref_model, inputs)
    old = None
    if off_policy:
        old_model = hf_model(checkpoints["old"])
        add_fused_lm_head(old_model, temperature=args.temperature)  # as GRPOTrainer patches its own model
        inputs["old_per_token_logps"] = trl_logps(trainer, old_model, inputs)
        old = completion_to_rows(inputs["old_per_token_logps"])
    sampler = None
    if importance is not None:  # as GRPOTrainer with vLLM: old log-probs from the policy, the ratio to vLLM's
        old_model = hf_model(checkpoints["old"])
        add_fused_lm_head(old_model, temperature=args.temperature)
        sampled = trl_logps(trainer, old_model, inputs)
        inputs["old_per_token_logps"] = trl_logps(trainer, trainer.model, inputs)
        inputs["importance_sampling_ratio"] = trl_importance_ratio(
            inputs["old_per_token_logps"], sampled, inputs["completion_mask"], **importance)
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        sampler = completion_to_rows(sampled)
    results = []
    for _ in range(calls):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results.append(GRPOResult(loss.item(), metrics, trl_reference.hf_grads(trainer.model), old, sampler))
    return results[0] if calls == 1 else results


# ---------------------------------------------------------------------------------------------------- jaxtune side


def objective_cfg(**keys) -> ObjectiveConfig:
    return objective_config(name="grpo", rewards=[{"name": "length"}], num_generations=GROUP,
                            max_completion_length=MAX_COMPLETION, **keys)


# A GRPO run, full fine-tuning, AdamW at lr 1e-2 with eps 0.1 (see the module's docstring).
GRPO_RUN = ("objective.name=grpo", "data.format=prompts", "data.sources=[prompts.jsonl]", f"data.seq_len={T}",
            "objective.prompts_per_step=2", "objective.rewards=[{name: length}]", f"objective.num_generations={GROUP}",
            f"objective.max_completion_length={MAX_COMPLETION}", "optim.lr=1e-2", "optim.eps=0.1",
            "optim.warmup_steps=0", "train.steps=3")


@pytest.fixture(scope="module")
def native(checkpoints) -> Native:
    return Native.of(checkpoints, *GRPO_RUN)


def ours(native: Native, params, batch, carry=None, **keys) -> Ours:
    """``objective.name=grpo`` (with ``keys``) on ``params`` as the train step forms it: `objective_loss`'s sums and
    their gradients divided by the objective's count, the metrics by `per_unit`. With beta > 0 the reference is the
    unperturbed checkpoint, as the frozen copy (`Frozen.companion`). ``carry``: what the train state carries for the
    objective (scalars the step puts in the batch)."""
    cfg = objective_cfg(**keys)
    means = lambda metrics, count: {k: float(v) for k, v in per_unit(metrics, count).items()}
    return trl_reference.objective_result(native, replace(make_objective(cfg), passes=1), cfg, params, batch, means,
                                          carry)


def assert_matches(mine: Ours, theirs: TRLResult, names=()) -> dict[str, float]:
    """Loss, the ``names`` metrics and the gradients within TOL; the errors."""
    return trl_reference.assert_close(mine, theirs, names, lambda k, a, b: rel(a[k], b[k]))


# ---------------------------------------------------------------------------------------------------- vs TRL


@pytest.mark.parametrize("layout", ["rows", "shared"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_tool_mask_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, layout):
    """Multi-turn rollouts: with tool-result tokens inside completions (TOOL_MASK 0), jaxtune's rows (a row per
    completion, or shared prompts) train on the model's tokens only, and the loss, the KL, the token counts and
    the gradients equal GRPOTrainer's with the same ``tool_mask`` (beta 0.04: the KL is masked too)."""
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, tool_mask=True, beta=0.04, loss_type=loss_type)
    prompt_ids, zeros = [prompt_of(i) for i in range(N)], [[0.0] * len(c) for c in COMPLETIONS]
    if layout == "rows":
        batch = {**training_rows(prompt_ids, COMPLETIONS, zeros, T, TOOL_MASK), "advantages": ADVANTAGES}
    else:
        batch = {**shared_rows(prompt_ids, COMPLETIONS, zeros, GROUP, T, MAX_COMPLETION, TOOL_MASK),
                 "advantages": ADVANTAGES.reshape(-1, GROUP)}
    model_tokens = sum(map(sum, TOOL_MASK))
    assert batch["loss_mask"].sum() == model_tokens < sum(map(len, COMPLETIONS))
    mine = ours(native, native.policy, batch, loss_type=loss_type, beta=0.04)
    assert mine.count == {"grpo": N, "dapo": model_tokens}[loss_type]
    assert_matches(mine, theirs, ("kl",))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_types_match_trl(checkpoints, tokenizer, native, tmp_path, loss_type):
    """beta = 0, on-policy (ratio 1): each loss type's loss and gradients equal GRPOTrainer's."""
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, beta=0.0, loss_type=loss_type)
    mine = ours(native, native.policy, our_batch(), loss_type=loss_type)
    tokens = float(our_batch()["loss_mask"].sum())
    assert mine.count == {"grpo": N, "dapo": tokens, "dr_grpo": N * MAX_COMPLETION}[loss_type]
    assert mine.metrics["kl"] == 0.0 and "kl" not in theirs.metrics
    assert_matches(mine, theirs)


def test_kl_penalty_matches_trl(checkpoints, tokenizer, native, tmp_path):
    """dapo with beta = 0.04 against the reference model (a frozen copy of the unperturbed checkpoint; TRL's
    ref_model with the same weights): loss, gradients and the kl metric equal GRPOTrainer's."""
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, beta=0.04, loss_type="dapo")
    mine = ours(native, native.policy, our_batch(), beta=0.04, loss_type="dapo")
    assert theirs.metrics["kl"] > 1e-3  # the policy is not the reference
    assert_matches(mine, theirs, names=("kl",))


def test_temperature_matches_trl(checkpoints, tokenizer, native, tmp_path):
    """temperature 0.7 (the policy's and the reference's log-probs of logits / 0.7 on both sides), dapo with beta =
    0.04 so that the loss too depends on it (on-policy, the policy term's value does not): loss, gradients and the
    kl metric equal GRPOTrainer's, and differ from temperature 1's."""
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, beta=0.04, loss_type="dapo", temperature=0.7)
    mine = ours(native, native.policy, our_batch(), beta=0.04, loss_type="dapo", temperature=0.7)
    assert_matches(mine, theirs, names=("kl",))
    at_one = ours(native, native.policy, our_batch(), beta=0.04, loss_type="dapo")
    assert abs(mine.metrics["kl"] - at_one.metrics["kl"]) > 1e-2 * at_one.metrics["kl"]
    assert rel(mine.grads["lm_head"]["embedding"], at_one.grads["lm_head"]["embedding"]) > 1e-2


@pytest.fixture(scope="module")
def off_policy(checkpoints, tokenizer, tmp_path_factory) -> GRPOResult:
    """GRPOTrainer's result with ``old_per_token_logps`` from the old checkpoint (dapo, OFF_POLICY clipping)."""
    return trl_grpo(checkpoints, tokenizer, tmp_path_factory.mktemp("trl"), off_policy=True, beta=0.0,
                    loss_type="dapo", **OFF_POLICY)


def test_old_logps_match_trl(native, off_policy):
    """mu > 1 semantics: with the batch's ``old_logps`` (the old checkpoint's, so ratios != 1), loss, gradients and
    the clip ratios equal GRPOTrainer's, some tokens clipped below and some above."""
    mine = ours(native, native.policy, our_batch(off_policy.old_logps), loss_type="dapo", **OFF_POLICY)
    assert all(off_policy.metrics[k] > 0 for k in CLIP_METRICS), off_policy.metrics
    assert_matches(mine, off_policy, names=CLIP_METRICS)


CISPO_CAP = 1.28  # cispo's epsilon_high: an absolute cap on the ratio, which some old-checkpoint ratios pass


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_cispo_matches_trl(checkpoints, tokenizer, native, tmp_path, beta):
    """loss_type=cispo with the old checkpoint's log-probs (ratios != 1, some above the cap): loss, gradients and
    ``cispo_clip_ratio`` equal GRPOTrainer's, with and without the KL term; the capped weight is held constant, so
    the update differs from dapo's clipped one on the same batch."""
    keys = {"beta": beta, "loss_type": "cispo", "epsilon_high": CISPO_CAP}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=True, **keys)
    mine = ours(native, native.policy, our_batch(theirs.old_logps), **keys)
    assert 0 < theirs.metrics["cispo_clip_ratio"] < 1, theirs.metrics
    assert "clip_ratio/region_mean" not in mine.metrics
    assert_matches(mine, theirs, names=("cispo_clip_ratio",))
    dapo = ours(native, native.policy, our_batch(theirs.old_logps), beta=beta, loss_type="dapo", epsilon_high=0.28)
    assert rel(dapo.loss, mine.loss) > 1e-3


def test_cispo_needs_its_cap():
    """cispo's epsilon_high is an absolute cap on the ratio: left unset it would default to epsilon (0.2, every
    weight cut to 0.2, as TRL does), so it is refused, naming the key."""
    with pytest.raises(ValueError, match="loss_type=cispo caps each token's ratio at objective.epsilon_high"):
        objective_cfg(loss_type="cispo")


@pytest.mark.parametrize("loss_type, beta, off", [("grpo", 0.0, True), ("grpo", 0.04, True), ("dapo", 0.0, False),
                                                ("cispo", 0.0, True)])
def test_sequence_level_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta, off):
    """importance_sampling_level=sequence (GSPO: each completion's ratio the exp of its tokens' mean log-ratio, the
    gradient through that mean, weighing its tokens' losses and the KL term): loss, gradients and the clip metrics,
    counted per completion as TRL logs them, equal GRPOTrainer's, with the old checkpoint's log-probs (some
    completions clipped, not all) and on-policy (dapo: none clipped), with and without the KL term, in rows and in
    shared-prompt rows."""
    clip = {"epsilon_high": 1 + SEQUENCE_CLIP["epsilon_high"]} if loss_type == "cispo" else SEQUENCE_CLIP
    keys = {"beta": beta, "loss_type": loss_type, "importance_sampling_level": "sequence", **clip}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    clipped = ("cispo_clip_ratio",) if loss_type == "cispo" else CLIP_METRICS
    shares = {k: theirs.metrics[k] * N for k in clipped}  # completions, not tokens: whole numbers
    assert all(v == pytest.approx(round(v), abs=1e-6) for v in shares.values()), shares
    region = shares.get("cispo_clip_ratio", shares.get("clip_ratio/region_mean"))
    assert 0 < region < N if off else region == 0, shares
    names = tuple(k for k in clipped if shares[k]) + (("kl",) if beta else ())
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, names)
        assert all(mine.metrics[k] == 0 for k in clipped if not shares[k])


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sequence_token_is_gspo_token(native, off_policy, beta):
    """importance_sampling_level=sequence_token (GSPO-token, which TRL 1.16 lacks) is the GSPO paper's formula,
    written out below: s_t = sg[s] · π(y_t) / sg[π(y_t)] with s the completion's exp mean log-ratio, -min(s_t A,
    clip(s_t) A) plus beta times the k3 KL weighted by s_t, each completion's mean, then the mean over completions.
    With the old checkpoint's log-probs its loss and gradients are the formula's, in rows and shared-prompt rows;
    its loss and metrics are ``sequence``'s (s_t's value is s). With one advantage per completion its policy term's
    gradient is ``sequence``'s too (the GSPO paper's remark): they differ through the KL term's weight, whose
    gradient is each token's own."""
    keys = {"loss_type": "grpo", "beta": beta, **SEQUENCE_CLIP}
    old, batch = off_policy.old_logps, our_batch(off_policy.old_logps)
    forward = native.spec.forward()
    rows = {k: jnp.asarray(v) for k, v in batch.items() if k in ("inputs", "targets", "positions", "segment_ids")}
    mask, adv = jnp.asarray(batch["loss_mask"]), jnp.asarray(ADVANTAGES)[:, None]
    low, high = 1 - SEQUENCE_CLIP["epsilon"], 1 + SEQUENCE_CLIP["epsilon_high"]

    def gspo_token(params, ref):
        logps = forward.token_logps(params, rows)
        s = jnp.exp(jnp.sum((logps - old) * mask, 1, keepdims=True) / jnp.sum(mask, 1, keepdims=True))
        s_t = jax.lax.stop_gradient(s) * jnp.exp(logps - jax.lax.stop_gradient(logps))
        delta = forward.token_logps(ref, rows) - logps
        per_token = -jnp.minimum(s_t * adv, jnp.clip(s_t, low, high) * adv) + beta * (
            jnp.exp(delta) - delta - 1) * s_t
        return jnp.mean(jnp.sum(per_token * mask, 1) / jnp.sum(mask, 1))

    with sharding.use_mesh(MESH):
        loss, grads = jax.jit(jax.value_and_grad(gspo_token), compiler_options=trl_reference.FAST_COMPILE)(
            native.policy, native.ref)
    sequence = ours(native, native.policy, batch, importance_sampling_level="sequence", **keys)
    assert 0 < sequence.metrics["clip_ratio/region_mean"] < 1
    for layout in (batch, shared_batch(old)):
        mine = ours(native, native.policy, layout, importance_sampling_level="sequence_token", **keys)
        assert rel(mine.loss, float(loss)) <= TOL and rel(mine.loss, sequence.loss) <= TOL
        assert all(rel(mine.metrics[k], v) <= TOL for k, v in sequence.metrics.items() if v), mine.metrics
        errors = [rel(a, b) for a, b in zip(jax.tree.leaves(mine.grads), jax.tree.leaves(grads), strict=True)]
        assert max(errors) <= TOL, errors
    apart = rel(mine.grads["lm_head"]["embedding"], sequence.grads["lm_head"]["embedding"])
    assert apart > 1e-3 if beta else apart <= TOL


def test_a_sequence_ratio_summed_over_tokens_is_warned_of(caplog):
    """A sequence-level ratio with a loss type that sums token losses (dapo, the default; dr_grpo; cispo) counts
    each completion by its length: TRL's warning, one line naming both keys and GSPO's loss type; none with grpo."""
    with caplog.at_level("WARNING", logger="jaxtune.config.objectives"):
        objective_cfg(importance_sampling_level="sequence")
        assert "importance_sampling_level=sequence with loss_type=dapo sums token losses" in caplog.text
        caplog.clear()
        objective_cfg(importance_sampling_level="sequence_token", loss_type="grpo")
        assert not caplog.records


@pytest.mark.parametrize("off, beta, level, temperatures", [
    (True, 0.0, "token", {}), (True, 0.04, "token", {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5}),
    (False, 0.04, "token", {"sapo_temperature_pos": 0.5}), (True, 0.0, "sequence", {})],
    ids=["off", "off-kl-tau", "on-kl-tau", "off-sequence"])
def test_sapo_matches_trl(checkpoints, tokenizer, native, tmp_path, off, beta, level, temperatures):
    """loss_type=sapo (the soft gate 4/τ · σ(τ (r - 1)) in place of the clip, averaged as grpo): loss, gradients and
    the kl metric equal GRPOTrainer's, on-policy and with the old checkpoint's log-probs, at TRL's temperatures and
    others, with token and sequence ratios, in rows and shared-prompt rows; no clip ratios logged on either side.
    Off-policy its update is not the clipped one's. (On-policy the gate is 2/τ and a group's advantages sum to 0, so
    at TRL's temperatures the loss nearly cancels; the on-policy case takes another τ where A > 0.)"""
    keys = {"loss_type": "sapo", "beta": beta, "importance_sampling_level": level, **temperatures}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    assert not any(k.startswith(("clip_ratio", "cispo")) for k in theirs.metrics), theirs.metrics
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, ("kl",) if beta else ())
        assert set(mine.metrics) == {"kl", "sampler_logp_diff/mean", "sampler_logp_diff/max"}
    if off:
        clipped = ours(native, native.policy, our_batch(theirs.old_logps), loss_type="grpo", beta=beta,
                       importance_sampling_level=level)
        assert rel(mine.grads["lm_head"]["embedding"], clipped.grads["lm_head"]["embedding"]) > 1e-3


@pytest.mark.parametrize("off, beta, level", [(True, 0.0, "sequence"), (True, 0.04, "sequence"),
                                              (False, 0.0, "sequence"), (True, 0.0, "token")],
                         ids=["off", "off-kl", "on", "off-token-ratios"])
def test_luspo_matches_trl(checkpoints, tokenizer, native, tmp_path, caplog, off, beta, level):
    """loss_type=luspo (each completion's summed loss, then the mean over completions): loss, gradients and the
    metrics (clip ratios per completion with a sequence ratio, per token with token ratios; kl) equal
    GRPOTrainer's, with LUSPO's sequence ratio on- and off-policy, with the KL term, and with token ratios (which
    TRL and jaxtune warn of), in rows and shared-prompt rows; the count is the completions."""
    keys = {"loss_type": "luspo", "beta": beta, "importance_sampling_level": level,
            **(SEQUENCE_CLIP if level == "sequence" else OFF_POLICY)}
    with caplog.at_level("WARNING", logger="jaxtune.config.objectives"):
        objective_cfg(**keys)
    assert ("LUSPO's is the sequence ratio" in caplog.text) == (level == "token")
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    assert (theirs.metrics["clip_ratio/region_mean"] > 0) == off
    names = tuple(k for k in CLIP_METRICS if theirs.metrics[k]) + (("kl",) if beta else ())
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert mine.count == N
        assert_matches(mine, theirs, names)


@pytest.mark.parametrize("off", [True, False], ids=["off", "on"])
def test_bnpo_is_dapo_and_trls_bnpo_on_one_micro_batch(checkpoints, tokenizer, native, tmp_path, off):
    """loss_type=bnpo is TRL's token mean per micro-batch. jaxtune's micro-batches add their sums and counts
    exactly, so its token mean is the whole batch's, dapo's, whatever the micro-batches
    (test_micro_batches_give_the_same_update): on one micro-batch, the batch TRL's bnpo sees here, loss, gradients
    and clip ratios equal GRPOTrainer's bnpo, on-policy and with the old checkpoint's log-probs; and they are our
    dapo's bit for bit, with the same count."""
    keys = {"loss_type": "bnpo", **OFF_POLICY}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    batch = our_batch(theirs.old_logps)
    mine = ours(native, native.policy, batch, **keys)
    assert_matches(mine, theirs, CLIP_METRICS if off else ())
    assert all(theirs.metrics[k] > 0 for k in CLIP_METRICS) == off
    dapo = ours(native, native.policy, batch, **{**keys, "loss_type": "dapo"})
    assert (mine.loss, mine.count, mine.metrics) == (dapo.loss, dapo.count, dapo.metrics)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(mine.grads), jax.tree.leaves(dapo.grads),
                                                    strict=True))


VESPO_GAMMA = {"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 0.5}


@pytest.mark.parametrize("off, beta, gamma", [(True, 0.0, {}), (True, 0.04, VESPO_GAMMA), (False, 0.0, {})],
                         ids=["off", "off-kl-gamma", "on"])
def test_vespo_matches_trl(checkpoints, tokenizer, native, tmp_path, off, beta, gamma):
    """loss_type=vespo (each token's log-prob weighted by its completion's gamma weight φ(w) of the sequence ratio,
    held constant; averaged as dapo): loss, gradients, ``vespo/phi_seq_mean`` and kl equal GRPOTrainer's,
    on-policy (φ = 1) and with the old checkpoint's log-probs, at TRL's k and λ and others, with the KL term, in rows
    and shared-prompt rows; no clip ratios."""
    keys = {"loss_type": "vespo", "beta": beta, **gamma}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    phi = theirs.metrics["vespo/phi_seq_mean"]
    assert (abs(phi - 1) > 1e-2) if off else phi == pytest.approx(1.0, abs=1e-6), phi
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, ("vespo/phi_seq_mean",) + (("kl",) if beta else ()))
        assert not any(k.startswith(("clip_ratio", "cispo")) for k in {*mine.metrics, *theirs.metrics})


@pytest.mark.parametrize("mode, clip_min, clip_max", [("token_truncate", None, 1.05), ("token_mask", 0.3, 3.0)])
def test_vespo_folds_the_sampler_weights_in_as_trl(checkpoints, tokenizer, native, tmp_path, mode, clip_min,
                                                   clip_max):
    """vespo with objective.importance_sampling (the old checkpoint's log-probs as the sampler's): the sampler's
    token weights enter each completion's sequence ratio, not the loss (a weight masked to 0 as 1e-8), as
    GRPOTrainer's vLLM correction does: loss, gradients and ``vespo/phi_seq_mean`` equal its. Sequence-level
    weights are refused (TRL's rule); a sequence policy ratio under vespo weighs only the KL term, which is warned
    of."""
    bounds = {"clip_min": clip_min, "clip_max": clip_max}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, importance={"mode": mode, **bounds}, loss_type="vespo")
    mine = ours(native, native.policy, our_batch(sampler_logps=theirs.sampler_logps), loss_type="vespo",
                importance_sampling=mode, importance_sampling_min=clip_min, importance_sampling_max=clip_max)
    assert abs(theirs.metrics["vespo/phi_seq_mean"] - 1) > 1e-2, theirs.metrics
    assert_matches(mine, theirs, ("vespo/phi_seq_mean",))
    with pytest.raises(ValueError, match=r"objective.importance_sampling=sequence_mask with loss_type=vespo: .* "
                                         r"choose token_truncate or token_mask"):
        objective_cfg(loss_type="vespo", importance_sampling="sequence_mask")


def test_vespo_with_a_sequence_policy_ratio_is_warned_of(caplog):
    """VESPO takes its own sequence ratio, so importance_sampling_level sequence under it weighs only the KL term:
    TRL's warning, one line."""
    with caplog.at_level("WARNING", logger="jaxtune.config.objectives"):
        objective_cfg(loss_type="vespo", importance_sampling_level="sequence")
    assert "importance_sampling_level=sequence under loss_type=vespo weighs only the KL term" in caplog.text


def test_a_loss_types_keys_are_refused_under_another():
    """sapo's temperatures or vespo's gamma keys under another loss type would change nothing: refused, naming the
    key, the loss type it applies to and the one set; at their defaults (what a saved config lists) they load."""
    with pytest.raises(ValueError, match=r"objective.sapo_temperature_neg applies to loss_type sapo, not dapo: drop "
                                         r"it or set objective.loss_type=sapo"):
        objective_cfg(sapo_temperature_neg=2.0)
    with pytest.raises(ValueError, match=r"objective.vespo_lambda_pos applies to loss_type vespo, not sapo"):
        objective_cfg(loss_type="sapo", vespo_lambda_pos=1.0)
    assert objective_cfg(loss_type="grpo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05).loss_type == "grpo"


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_two_sided_clip_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta):
    """delta (two-sided clipping) off-policy: the unclipped term's ratio capped at delta; loss, gradients, clip
    ratios and kl equal GRPOTrainer's, and differ from no cap (some negative-advantage tokens' ratios pass 1.3)."""
    keys = {"beta": beta, "loss_type": loss_type, **OFF_POLICY, "delta": 1.3}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=True, **keys)
    names = tuple(k for k in ("kl", *CLIP_METRICS) if theirs.metrics.get(k))
    batch = our_batch(theirs.old_logps)
    mine = ours(native, native.policy, batch, **keys)
    assert_matches(mine, theirs, names)
    ratio = np.exp(np.asarray(jax.jit(native.spec.forward().token_logps)(native.policy, {
        k: batch[k] for k in ("inputs", "targets", "positions", "segment_ids")})) - batch["old_logps"])
    assert np.any((ratio > 1.3) & (batch["loss_mask"] > 0) & (ADVANTAGES[:, None] < 0))
    plain = ours(native, native.policy, batch, **{**keys, "delta": None})
    assert rel(plain.loss, mine.loss) > 1e-4


def test_kl_without_bias_correction_matches_trl(checkpoints, tokenizer, native, tmp_path):
    """use_bias_correction_kl=false, off-policy with beta 0.04: the plain k3 term (not weighted by the ratio); loss,
    gradients and kl equal GRPOTrainer's, and differ from the corrected term's."""
    keys = {"beta": 0.04, "loss_type": "dapo", **OFF_POLICY, "use_bias_correction_kl": False}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=True, **keys)
    mine = ours(native, native.policy, our_batch(theirs.old_logps), **keys)
    assert_matches(mine, theirs, ("kl", *CLIP_METRICS))
    corrected = ours(native, native.policy, our_batch(theirs.old_logps), **{**keys, "use_bias_correction_kl": True})
    assert rel(corrected.metrics["kl"], mine.metrics["kl"]) > 1e-4


def test_two_sided_clip_and_kl_keys_are_checked():
    """delta on a loss type without a clip, or not above 1 + epsilon_high, and use_bias_correction_kl without a KL
    term: one line each naming the key and what to do."""
    with pytest.raises(ValueError, match=r"objective.delta caps the unclipped ratio .* loss_type=sapo has no clip"):
        objective_cfg(loss_type="sapo", delta=4.0)
    with pytest.raises(ValueError, match=r"objective.delta=1.2 must exceed the upper clip 1 \+ epsilon_high = 1.28"):
        objective_cfg(delta=1.2, epsilon_high=0.28)
    with pytest.raises(ValueError, match=r"objective.use_bias_correction_kl weighs the KL term, which beta=0"):
        objective_cfg(use_bias_correction_kl=False)
    assert objective_cfg(delta=None, use_bias_correction_kl=True).delta is None


def sampler_drift(native: Native, sampler: np.ndarray) -> np.ndarray:
    """(N,): each completion's mean over its tokens of log pi_sampler - log pi (the policy's), OPSM's measure."""
    rows = {k: v for k, v in our_batch().items() if k in ("inputs", "targets", "positions", "segment_ids")}
    policy = np.asarray(jax.jit(native.spec.forward().token_logps)(native.policy, rows))
    mask = our_batch()["loss_mask"]
    return ((sampler - policy) * mask).sum(-1) / mask.sum(-1)


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_off_policy_mask_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta):
    """off_policy_mask_threshold (OPSM) with the old checkpoint's log-probs as the sampler's (TRL's
    ``get_off_policy_mask`` on its old log-probs, having no vLLM ones): a threshold between the drifts of the two
    negative-advantage completions drops one of them; loss, gradients and the metrics equal GRPOTrainer's, with and
    without the KL term (left unmasked, as TRL's), in rows and shared-prompt rows; and the loss differs from the
    unmasked one."""
    old = trl_grpo(checkpoints, tokenizer, tmp_path / "old", off_policy=True, beta=0.0).old_logps
    drift = sampler_drift(native, old)[ADVANTAGES < 0]
    assert len(drift) == 2 and abs(drift[0] - drift[1]) > 1e-3, drift
    keys = {"beta": beta, "loss_type": loss_type, **OFF_POLICY, "off_policy_mask_threshold": float(drift.mean())}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path / "masked", off_policy=True, **keys)
    names = CLIP_METRICS + (("kl",) if beta else ())
    names = tuple(k for k in names if theirs.metrics[k])
    shared = shared_batch(old)
    shared[SAMPLER_LOGPS_KEY] = shared["old_logps"]
    for batch in (our_batch(old, sampler_logps=old), shared):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, names)
    unmasked = ours(native, native.policy, our_batch(old, sampler_logps=old), **{**keys,
                                                                              "off_policy_mask_threshold": None})
    assert rel(unmasked.loss, mine.loss) > 1e-3


@pytest.mark.parametrize("loss_type, beta, quantile, off", [("dapo", 0.0, 0.3, True), ("grpo", 0.04, 0.8, False),
                                                          ("vespo", 0.0, 0.2, True)])
def test_entropy_mask_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta, quantile, off):
    """top_entropy_quantile < 1: only the completion tokens at or above the batch's (1 - rho) entropy quantile carry
    the policy loss (the KL term all): loss, gradients, the ``entropy`` metric (mean over completion tokens) and the
    others equal GRPOTrainer's on one micro-batch, on- and off-policy, with the KL term, under vespo, in rows and
    shared-prompt rows; and differ from rho = 1's, which logs no entropy."""
    keys = {"beta": beta, "loss_type": loss_type, "top_entropy_quantile": quantile}
    keys.update(OFF_POLICY if loss_type != "vespo" else {})
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=off, **keys)
    names = ("entropy", "kl", "vespo/phi_seq_mean", *CLIP_METRICS)
    names = tuple(k for k in names if theirs.metrics.get(k))
    assert "entropy" in names
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, names)
    every = ours(native, native.policy, our_batch(theirs.old_logps), **{**keys, "top_entropy_quantile": 1.0})
    assert rel(every.loss, mine.loss) > 1e-3 and "entropy" not in every.metrics


@pytest.mark.parametrize("loss_type, beta, quantile, coef", [("dapo", 0.0, 1.0, 0.05), ("grpo", 0.04, 0.5, 0.1),
                                                          ("dr_grpo", 0.0, 1.0, -0.02)])
def test_entropy_bonus_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta, quantile, coef):
    """entropy_coef: the loss less coef x the mean entropy over the tokens the policy loss acts on (all completion
    tokens, or the entropy mask's), the gradient through the entropy: loss, gradients and ``entropy``,
    ``policy_loss`` and ``entropy_coef`` equal GRPOTrainer's (off-policy), whatever the loss type's normalisation."""
    keys = {"beta": beta, "loss_type": loss_type, "top_entropy_quantile": quantile, "entropy_coef": coef,
            **OFF_POLICY}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=True, **keys)
    names = tuple(k for k in ("entropy", "policy_loss", "entropy_coef", "kl", *CLIP_METRICS) if theirs.metrics.get(k))
    assert {"entropy", "policy_loss", "entropy_coef"} <= set(names)
    for batch in (our_batch(theirs.old_logps), shared_batch(theirs.old_logps)):
        mine = ours(native, native.policy, batch, **keys)
        assert_matches(mine, theirs, names)
    plain = ours(native, native.policy, our_batch(theirs.old_logps), **{**keys, "entropy_coef": 0.0})
    assert rel(plain.grads["lm_head"]["embedding"], mine.grads["lm_head"]["embedding"]) > 1e-3


def initial(objective: GRPO) -> dict[str, jax.Array]:
    """The objective's initial carry as the train state holds it (float32 scalars)."""
    return {k: jnp.float32(v) for k, v in objective.init_carry().items()}


@pytest.mark.parametrize("loss_type, beta, quantile, gap, coef, delta", [
    ("dapo", 0.0, 1.0, 0.5, 0.02, 0.01),  # entropy under the target: the weight rises, applied from the 2nd update
    ("grpo", 0.04, 0.5, 0.5, 0.985, 0.01),  # the same at entropy_coef_max (clamped), on the high-entropy tokens
    ("dr_grpo", 0.0, 1.0, -0.5, 0.05, 0.02)])  # over the target: the weight falls and is never applied
def test_adaptive_entropy_matches_trl(checkpoints, tokenizer, native, tmp_path, loss_type, beta, quantile, gap, coef,
                                      delta):
    """use_adaptive_entropy over three optimizer-step boundaries on the same weights and batch (TRL: three
    ``compute_loss`` calls; ours: the objective with the carried weight, then `GRPO.advance` on its metric means):
    each call's loss, gradients, entropy, policy_loss and the loss type's metrics, and the weight logged after it
    (``entropy_coef``) equal GRPOTrainer's; with the target ``gap`` nats above the entropy measured (over the tokens
    the policy loss acts on) the weight climbs by delta up to entropy_coef_max and is applied from the second call,
    below it the weight falls and the loss is the policy loss."""
    keys = {"beta": beta, "loss_type": loss_type, "top_entropy_quantile": quantile, "use_adaptive_entropy": True,
            "entropy_coef": coef, "entropy_coef_delta": delta, "entropy_target": 1.0}
    probe = make_objective(objective_cfg(**keys))
    h = ours(native, native.policy, our_batch(), initial(probe), **keys).metrics[probe.measured_entropy]
    keys["entropy_target"] = h + gap
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, calls=3, **keys)
    objective = make_objective(objective_cfg(**keys))
    carry, weights, bonuses = initial(objective), [], []
    for call in theirs:
        mine = ours(native, native.policy, our_batch(), carry, **keys)
        names = tuple(k for k in ("entropy", "policy_loss", "kl", *CLIP_METRICS) if call.metrics.get(k))
        assert {"entropy", "policy_loss"} <= set(names)
        assert_matches(mine, call, names)
        carry, logged = objective.advance(carry, {k: jnp.float32(v) for k, v in mine.metrics.items()})
        assert float(logged["entropy_coef"]) == pytest.approx(call.metrics["entropy_coef"], rel=TOL, abs=1e-9)
        weights.append(float(logged["entropy_coef"]))
        bonuses.append(mine.metrics["policy_loss"] - mine.loss)
    step = delta if gap > 0 else -delta
    assert weights == pytest.approx([min(max(coef + k * step, 0.0), 1.0) for k in (1, 2, 3)], rel=1e-6)
    none = [abs(b) <= 1e-7 for b in bonuses]  # policy_loss (a float32 mean) less the loss (float64 of the sum / n)
    assert none == ([True, False, False] if gap > 0 else [True] * 3), bonuses
    assert gap < 0 or min(bonuses[1:]) > 1e-4
    assert float(carry[LAST_ENTROPY]) == pytest.approx(h, rel=1e-6)


def test_adaptive_entropy_through_the_train_step(native, off_policy):
    """The train step carries adaptive entropy control's weight in the state: one update on a batch in 2
    micro-batches of different token counts carries and logs what 1 does (the entropy over the whole batch), and
    updates as the loss without a bonus (nothing measured before it); the next applies the weight (loss = policy_loss
    - c H); with num_iterations=2 one step moves the weight twice and logs the last."""
    keys = {"loss_type": "dapo", "use_adaptive_entropy": True, "entropy_coef": 0.02, "entropy_coef_delta": 0.01,
            "entropy_target": 50.0, **OFF_POLICY}
    objective = make_objective(objective_cfg(**keys))
    batch = our_batch(off_policy.old_logps)
    state, out = stepped(native, objective, batch, carry=initial(objective))
    (one, m1), (two, m2) = out[1], out[2]
    assert update_error(two, one, state.params) <= STEP_TOL
    for k in ("loss", "entropy", "policy_loss", "entropy_coef"):
        assert abs(float(m2[k]) - float(m1[k])) <= STEP_TOL * abs(float(m1[k])), (k, m1[k], m2[k])
    assert float(m1["entropy_coef"]) == pytest.approx(0.03) and float(m1["loss"]) == float(m1["policy_loss"])
    plain = make_objective(objective_cfg(**{**keys, "use_adaptive_entropy": False, "entropy_coef": 0.0,
                                            "entropy_coef_delta": 0.005, "entropy_target": 0.2}))
    _, out_plain = stepped(native, plain, batch, splits=(1,))
    assert update_error(one, out_plain[1][0], state.params) <= STEP_TOL
    with sharding.use_mesh(MESH):
        step = jit_step(native, objective)
        first, _ = step(state._replace(carry=initial(objective)), sharding.global_batch(MESH, batch))
        assert float(first.carry[LAST_ENTROPY]) == pytest.approx(float(m1["entropy"]), rel=1e-6)
        _, m = step(first, sharding.global_batch(MESH, batch))
    h, loss, policy = (float(m[k]) for k in ("entropy", "loss", "policy_loss"))
    assert loss == pytest.approx(policy - 0.03 * h, rel=1e-5) and float(m["entropy_coef"]) == pytest.approx(0.04)
    twice = make_objective(objective_cfg(**keys, num_iterations=2))
    _, out_twice = stepped(native, twice, batch, splits=(1,), carry=initial(twice))
    assert float(out_twice[1][1]["entropy_coef"]) == pytest.approx(0.04)


def test_adaptive_entropy_keys_are_checked():
    """The control's keys without use_adaptive_entropy would change nothing: refused, naming both keys; an initial
    weight outside [entropy_coef_min, entropy_coef_max] is refused; at their defaults they load."""
    with pytest.raises(ValueError, match=r"objective.entropy_target applies with objective.use_adaptive_entropy=true"):
        objective_cfg(entropy_target=1.0)
    with pytest.raises(ValueError, match=r"objective.entropy_coef=0.5 .* outside \[entropy_coef_min, "
                                         r"entropy_coef_max\] = \[0.0, 0.2\]"):
        objective_cfg(use_adaptive_entropy=True, entropy_coef=0.5, entropy_coef_max=0.2, entropy_target=1.0)
    assert not objective_cfg(entropy_coef_min=0.0, entropy_target=0.2).use_adaptive_entropy
    assert make_objective(objective_cfg(entropy_coef=0.1)).init_carry() == {}


def test_chunked_entropy_is_the_whole_logits(native):
    """The entropy from log-prob chunks of 4 positions (`chunked_token_logps`) equals the one from the whole
    logits, and the log-probs beside it equal `token_logps`' alone."""
    rows = {k: v for k, v in our_batch().items() if k in ("inputs", "targets", "positions", "segment_ids")}
    whole, chunked = native.spec.forward(), native.spec.forward(loss_chunk=4)
    logps, entropy = jax.jit(lambda p: whole.token_logps_and_entropy(p, rows, None, 0.7))(native.policy)
    c_logps, c_entropy = jax.jit(lambda p: chunked.token_logps_and_entropy(p, rows, None, 0.7))(native.policy)
    alone = jax.jit(lambda p: whole.token_logps(p, rows, None, 0.7))(native.policy)
    assert np.array_equal(np.asarray(logps), np.asarray(alone))
    assert rel(np.asarray(c_entropy), np.asarray(entropy)) <= 1e-6 and rel(np.asarray(c_logps), alone) <= 1e-6
    assert np.all(np.asarray(entropy) > 0)


@pytest.fixture(scope="module")
def off_policy_kl(checkpoints, tokenizer, native, tmp_path_factory) -> tuple[Ours, TRLResult]:
    """dapo with beta = 0.04 and ``old_logps`` from the old checkpoint: (ours, GRPOTrainer's)."""
    keys = {"beta": 0.04, "loss_type": "dapo", **OFF_POLICY}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path_factory.mktemp("trl"), off_policy=True, **keys)
    return ours(native, native.policy, our_batch(theirs.old_logps), **keys), theirs


@pytest.mark.parametrize("mode, clip_min, clip_max", [("token_truncate", None, 1.05), ("token_mask", 0.3, 3.0),
                                                     ("sequence_truncate", 0.9, 1.1), ("sequence_mask", 0.6, 1.5)])
def test_importance_sampling_matches_trl(checkpoints, tokenizer, native, tmp_path, mode, clip_min, clip_max):
    """objective.importance_sampling (the old checkpoint's log-probs as the sampler's, so ratios != 1): each of
    TRL's four modes, with dapo and beta = 0.04, gives GRPOTrainer's loss and gradients with its vLLM correction; the
    bounds cut some ratios (token) or completions (sequence) and leave others; the logged sampler_logp_diff is the
    mean and max |trainer - sampler| over completion tokens."""
    bounds = {"clip_min": clip_min, "clip_max": clip_max}
    theirs = trl_grpo(checkpoints, tokenizer, tmp_path, importance={"mode": mode, **bounds}, beta=0.04,
                      loss_type="dapo")
    mine = ours(native, native.policy, our_batch(sampler_logps=theirs.sampler_logps), beta=0.04, loss_type="dapo",
                importance_sampling=mode, importance_sampling_min=clip_min, importance_sampling_max=clip_max)
    assert_matches(mine, theirs)
    assert mine.metrics["importance_sampling_ratio/min"] < mine.metrics["importance_sampling_ratio/max"]
    lo, hi = mine.metrics["importance_sampling_ratio/min"], mine.metrics["importance_sampling_ratio/max"]
    near = lambda x, bound: bound is not None and x == pytest.approx(bound, rel=1e-6)
    cut = near(hi, clip_max) or near(lo, clip_min) or lo == 0.0
    assert cut, mine.metrics
    rows = {k: v for k, v in our_batch().items() if k in ("inputs", "targets", "positions", "segment_ids")}
    policy = np.asarray(jax.jit(native.spec.forward().token_logps)(native.policy, rows))
    mask = our_batch()["loss_mask"]
    gap = np.abs(policy - theirs.sampler_logps)[mask > 0]
    assert mine.metrics["sampler_logp_diff/max"] == pytest.approx(gap.max(), rel=1e-5)
    assert mine.metrics["sampler_logp_diff/mean"] == pytest.approx(gap.mean(), rel=1e-5)


def test_kl_penalty_with_old_logps_matches_trl(off_policy_kl):
    """beta > 0 with ``old_logps``: the KL term weighted by the ratio, as TRL's use_bias_correction_kl: loss and
    gradients equal GRPOTrainer's."""
    assert_matches(*off_policy_kl)


def test_kl_metric_with_old_logps_is_trls(off_policy_kl):
    """The ``kl`` metric with ``old_logps`` (ratios != 1) vs GRPOTrainer's logged ``kl``."""
    mine, theirs = off_policy_kl
    assert rel(mine.metrics["kl"], theirs.metrics["kl"]) <= TOL, (mine.metrics["kl"], theirs.metrics["kl"])


# ---------------------------------------------------------------------------------------------------- train step


_JITTED: dict[tuple[int, int, int], tuple[GRPO, object]] = {}


def jit_step(native: Native, objective: GRPO, micro_batches: int = 1):
    """The train step `build_steps` makes for ``objective``, jitted (state not donated: reused), once per objective
    object and number of micro-batches (a test that steps again reuses the compiled program)."""
    key = (id(native), id(objective), micro_batches)
    if key not in _JITTED or _JITTED[key][0] is not objective:  # the objective held: its id is not reused
        step, _ = build_steps(native.spec, objective, TrainConfig(batch_size=N, micro_batches=micro_batches))
        _JITTED[key] = (objective, jax.jit(step, compiler_options=trl_reference.FAST_COMPILE))
    return _JITTED[key][1]


def stepped(native: Native, objective: GRPO, batch: dict[str, np.ndarray], splits=(1, 2), carry=None):
    """The train step from the spec's initial state (with the objective's ``carry``) on ``batch`` in each number of
    micro-batches of ``splits``: the initial state and {micro-batches: (new params, metrics)} on the host."""
    state = native.spec.init(0)._replace(carry=carry or {})
    out = {}
    with sharding.use_mesh(MESH):
        for m in splits:
            new, metrics = jit_step(native, objective, m)(state, sharding.global_batch(MESH, batch))
            out[m] = (jax.device_get(new.params), jax.device_get(metrics))
    return state, out


def test_micro_batches_give_the_same_update(native, off_policy):
    """dapo (count: tokens) with ``old_logps`` (some ratios clipped): the train step in 2 micro-batches of different
    token counts makes the update, loss and metrics of the step in 1."""
    objective = make_objective(objective_cfg(loss_type="dapo", **OFF_POLICY))
    batch = our_batch(off_policy.old_logps)
    state, out = stepped(native, objective, batch)
    (one, m1), (two, m2) = out[1], out[2]
    assert float(m1["count"]) == float(m2["count"]) == batch["loss_mask"].sum()
    assert m1["clip_ratio/region_mean"] > 0
    for k in ("loss", "grad_norm", "kl", *CLIP_METRICS, "sampler_logp_diff/mean", "sampler_logp_diff/max"):
        assert abs(float(m2[k]) - float(m1[k])) <= STEP_TOL * max(abs(float(m1[k])), 1e-30), (k, m1[k], m2[k])
    assert update_error(two, one, state.params) <= STEP_TOL


def test_entropy_bonus_micro_batches_give_the_same_update(native, off_policy):
    """dapo with entropy_coef (the bonus a token sum: coef x each micro-batch's summed entropy) through the train
    step: 2 micro-batches of different token counts make the update, loss and entropy metrics of 1."""
    objective = make_objective(objective_cfg(loss_type="dapo", entropy_coef=0.05, **OFF_POLICY))
    state, out = stepped(native, objective, our_batch(off_policy.old_logps))
    (one, m1), (two, m2) = out[1], out[2]
    assert float(m1["entropy"]) > 0 and float(m1["policy_loss"]) != float(m1["loss"])
    for k in ("loss", "grad_norm", "entropy", "policy_loss", "entropy_coef"):
        assert abs(float(m2[k]) - float(m1[k])) <= STEP_TOL * max(abs(float(m1[k])), 1e-30), (k, m1[k], m2[k])
    assert update_error(two, one, state.params) <= STEP_TOL


# Every loss type with its own normalisation (tokens of the batch, completions, completions x max length, each
# completion's sum): the keys each needs (cispo's cap), and a sequence-level ratio for GSPO's per-completion means.
ACCUMULATED = [({"loss_type": t, **OFF_POLICY}) for t in ("dapo", "grpo", "dr_grpo", "bnpo", "sapo", "vespo")] + [
    {"loss_type": "cispo", "epsilon_high": CISPO_CAP}, {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", **OFF_POLICY}]


# Shared-prompt rows for one loss type per normalisation (the others normalise as one of these): 5 of the 9, each
# case two compiled steps.
SHARED = [k for k in ACCUMULATED if k["loss_type"] in ("dapo", "grpo", "dr_grpo", "luspo")]


@pytest.mark.parametrize("keys, layout", [*((k, "rows") for k in ACCUMULATED), *((k, "shared") for k in SHARED)],
                         ids=lambda v: "-".join(str(x) for x in v.values()) if isinstance(v, dict) else v)
def test_every_loss_type_accumulates_exactly(native, off_policy, keys, layout):
    """Exact accumulation: the train step over micro-batches of very different token counts (completions of 2 to 12
    tokens, split every 4th row: 5 to 20 completion tokens each; shared-prompt rows: one group each) makes the update,
    loss and metrics of the whole batch at once, whatever the loss type normalises by, with old log-probs (ratios
    off 1, clipping active). A mean of micro-batch means (TRL's bnpo, or any per-micro-batch normalisation) would
    differ here."""
    objective = make_objective(objective_cfg(**keys))
    batch = our_batch(off_policy.old_logps) if layout == "rows" else shared_batch(off_policy.old_logps)
    splits = (1, 4) if layout == "rows" else (1, 2)
    state, out = stepped(native, objective, batch, splits)
    (one, m1), (many, mm) = [(p, {k: float(v) for k, v in m.items()}) for p, m in (out[n] for n in splits)]
    if layout == "rows":  # the micro-batches really are ragged
        tokens = [batch["loss_mask"][i::4].sum() for i in range(4)]
        assert min(tokens) * 3 <= max(tokens), tokens
    for k in m1:
        if k.endswith(("/min", "/max")) or not np.isfinite(m1[k]):
            continue
        assert abs(mm[k] - m1[k]) <= TOL * max(abs(m1[k]), 1e-30) + 1e-9, (k, m1[k], mm[k])
    # TOL (1e-5): float32 sums in another order (measured up to 1.3e-6); a mean of micro-batch means is off by %s
    assert update_error(many, one, state.params, ulps=2) <= TOL


PREPARED: list[int] = []  # CountedGRPO.prepare's calls


class CountedGRPO(GRPO):
    """GRPO counting its `prepare` calls (made while tracing: once per traced step)."""

    def prepare(self, forward, weights, batch, reference=None):
        PREPARED.append(1)
        return super().prepare(forward, weights, batch, reference)


def test_num_iterations_is_two_updates_with_fixed_old_logps(native):
    """objective.num_iterations=2: one call of the step takes the old log-probs once (`GRPO.prepare`, the weights
    before the step) and makes 2 AdamW updates, the second with the ratio of the once-updated weights to those: the
    same parameters as the two updates made by hand with the spec's optimizer (and not those made with the old
    log-probs re-taken before the second update). The step's loss is the first pass's; its clip ratios and kl the
    mean of the two passes' (TRL logs them at each optimizer step: the first pass alone, ratio 1, clips nothing)."""
    cfg = objective_cfg(num_iterations=2, loss_type="dapo", **OFF_POLICY)
    objective = make_objective(cfg)
    assert objective.passes == 2
    counted = CountedGRPO(**{k: getattr(objective, k) for k in objective.__dataclass_fields__})
    state = native.spec.init(0)
    batch = our_batch()
    with sharding.use_mesh(MESH):
        new, metrics = jit_step(native, counted)(state, sharding.global_batch(MESH, batch))
    assert len(PREPARED) == 1 and int(new.step) == 1
    counts = [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(new.opt_state, "count")]
    assert counts and all(c == 2 for c in counts), counts  # AdamW's (and its schedule's) update count

    # By hand: old log-probs of the first weights, then two updates with the spec's optimizer.
    forward, spec = native.spec.forward(), native.spec
    logps = jax.jit(lambda params: objective.logps(forward, spec.weights(params, ()), batch, None))
    tx_update = jax.jit(lambda g, s, p: spec.tx.update(g, s, p))

    def update(params, opt_state, old):
        mine = ours(native, params, our_batch(np.asarray(old)), loss_type="dapo", **OFF_POLICY)
        updates, opt_state = tx_update(mine.grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mine

    with sharding.use_mesh(MESH):
        old = logps(state.params)
        params1, opt1, first = update(state.params, state.opt_state, old)
        params2, _, second = update(params1, opt1, old)
        retaken, _, _ = update(params1, opt1, logps(params1))
    assert abs(float(metrics["loss"]) - first.loss) <= STEP_TOL * abs(first.loss)
    assert second.metrics["clip_ratio/region_mean"] > 0 == first.metrics["clip_ratio/region_mean"]
    for k in (*CLIP_METRICS, "kl"):
        want = (first.metrics[k] + second.metrics[k]) / 2
        assert abs(float(metrics[k]) - want) <= STEP_TOL * max(abs(want), 1e-30), (k, metrics[k], want)
    assert update_error(new.params, params2, state.params, ulps=2) <= STEP_TOL
    assert update_error(retaken, params2, state.params) > 1e-3  # the fixed old log-probs are felt


# ---------------------------------------------------------------------------------------------------- rewards

TRL_REWARDS = '''
def correct(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]


def shorter(prompts, completions, completion_ids, trainer_state, **kwargs):
    return [10.0 - len(ids) + trainer_state.global_step for ids in completion_ids]


def long_only(completions, **kwargs):  # None: does not apply
    return [None if len(c[0]["content"]) < 6 else 1.0 for c in completions]


def named_only(prompts, completions, answer, level, **kwargs):
    return [float(len(p) + (a in c[0]["content"])) * lv for p, c, a, lv in zip(prompts, completions, answer, level)]
'''


def test_trl_reward_functions_score_as_in_grpo_trainer(checkpoints, tokenizer, tmp_path, monkeypatch):
    """Reward functions written for TRL's GRPOTrainer (dataset columns as keywords, conversational completions,
    completion_ids, trainer_state, None for "does not apply"), named in
    objective.rewards: jaxtune's per-function scores and weighted totals equal GRPOTrainer._calculate_rewards' on
    the same prompts, completions and rows; a column the data lacks is one error naming it."""
    from trl import GRPOConfig, GRPOTrainer

    from jaxtune.rollout.rewards import RewardError, make_rewards

    (tmp_path / "trl_style_rewards.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import trl_style_rewards as module

    names, weights = ["correct", "shorter", "long_only", "named_only"], [1.0, 0.5, 2.0, 1.0]
    prompts = [[{"role": "user", "content": q}] for q in ("2+2?", "2+2?", "3+4?", "3+4?")]
    completions = ["it is 4", "5", "7, so 7", "8"]
    ids = [[5, 6, 7], [8], [9, 10, 11, 12], [13]]
    rows = [{"answer": a, "level": lv} for a, lv in (("4", 1), ("4", 1), ("7", 2), ("7", 2))]
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=4, reward_weights=weights)
    trainer = GRPOTrainer(model=hf_model(checkpoints["policy"]), reward_funcs=[getattr(module, n) for n in names],
                          args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["w5"]}),
                          processing_class=tokenizer)
    inputs = [{"prompt": p, **r} for p, r in zip(prompts, rows)]
    theirs = trainer._calculate_rewards(inputs, prompts, [[{"role": "assistant", "content": c}] for c in completions],
                                        ids).numpy()
    their_total = np.nansum(theirs * np.asarray(weights, np.float32)[None], axis=1)

    reward_cfg = lambda rewards: objective_config(name="grpo", rewards=rewards)
    cfg = reward_cfg([{"name": f"trl_style_rewards:{n}", "weight": w} for n, w in zip(names, weights)])
    ours_ = make_rewards(cfg).score(prompts, completions, rows, [len(i) for i in ids], ["t:1"] * 4, completion_ids=ids)
    assert np.isnan(theirs[:, 2]).sum() == 2  # two completions where long_only does not apply
    np.testing.assert_array_equal(np.isnan(ours_.per_function), np.isnan(theirs))
    np.testing.assert_allclose(ours_.per_function, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours_.total, their_total, rtol=1e-6)
    assert np.isfinite(ours_.total).all() and ours_.errors == {}

    lacking = reward_cfg([{"name": "trl_style_rewards:named_only"}])
    with pytest.raises(RewardError, match=r"takes 'level', which is not a column of the data \(columns: answer\)"):
        make_rewards(lacking).score(prompts, completions, [{"answer": r["answer"]} for r in rows], [1] * 4,
                                    ["t:1"] * 4, completion_ids=ids)


# ---------------------------------------------------------------------------------------------------- RLOO
# RLOO (`jaxtune.train.objectives.rloo`) against TRL 1.16's RLOOTrainer: the loss (``_compute_loss``, a real trainer
# as for GRPO) and the advantages (the formulas of its ``_generate_and_score_completions``, transcribed below with
# its `nanstd`). Tolerances as GRPO's: rel <= 1e-5.


def trl_rloo_advantages(rewards: list[float], kl: np.ndarray, beta: float, normalize: bool) -> np.ndarray:
    """RLOOTrainer's advantages (TRL 1.16, ``_generate_and_score_completions``): the KL penalty in the reward, the
    leave-one-out baseline over each group's scorable completions (NaN rewards: unscorable), the optional
    normalisation over the batch, NaN to 0."""
    from trl.trainer.utils import nanstd

    r = torch.tensor(rewards, dtype=torch.float64) - beta * torch.tensor(kl, dtype=torch.float64)
    grouped = r.view(-1, GROUP)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = r - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).numpy()


RLOO_ADVANTAGES = leave_one_out_advantages(np.array(REWARDS), np.array(REWARDS)[:, None], GROUP)


def rloo_cfg(**keys) -> ObjectiveConfig:
    return objective_config(name="rloo", rewards=[{"name": "length"}], num_generations=GROUP,
                            max_completion_length=MAX_COMPLETION, **keys)


def rloo_batch(old_logps: np.ndarray | None = None) -> dict[str, np.ndarray]:
    return {**our_batch(old_logps), "advantages": RLOO_ADVANTAGES}


def trl_rloo(checkpoints, tokenizer, tmp_path, off_policy: bool = False, **config) -> TRLResult:
    """RLOOTrainer (the perturbed policy): ``compute_loss`` on the rollout with RLOO_ADVANTAGES and ``old_logps`` (a
    completion's summed log-probs) of the policy itself, or of the old checkpoint (``off_policy``)."""
    from trl import RLOOConfig, RLOOTrainer
    from trl.trainer.utils import add_fused_lm_head

    assert trl.__version__ == TRL_VERSION, f"these comparisons were written against TRL {TRL_VERSION}"
    args = RLOOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=N, num_generations=GROUP, max_completion_length=MAX_COMPLETION,
                      **config)
    data = datasets.Dataset.from_dict({"prompt": ["w5 w9", "w10 w11"]})
    trainer = RLOOTrainer(model=hf_model(checkpoints["policy"]), reward_funcs=lambda completions, **_: [0.0] * len(
        completions), args=args, train_dataset=data, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = {**trl_inputs(), "advantages": torch.tensor(RLOO_ADVANTAGES)}
    model = trainer.model
    if off_policy:
        model = hf_model(checkpoints["old"])
        add_fused_lm_head(model, temperature=args.temperature)
    per_token = trl_logps(trainer, model, inputs)
    inputs["old_logps"] = (per_token * inputs["completion_mask"]).sum(1)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return GRPOResult(loss.item(), metrics, trl_reference.hf_grads(trainer.model), completion_to_rows(per_token))


def rloo_ours(native: Native, batch, **keys) -> Ours:
    cfg = rloo_cfg(**keys)
    means = lambda metrics, count: {k: float(v) for k, v in per_unit(metrics, count).items()}
    return trl_reference.objective_result(native, replace(make_objective(cfg), passes=1), cfg, native.policy, batch,
                                          means)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "old-logps"])
def test_rloo_loss_matches_trl(checkpoints, tokenizer, native, tmp_path, off_policy):
    """The per-sequence clipped loss: on-policy (ratio 1: the plain leave-one-out policy gradient) and with the old
    checkpoint's log-probs (some sequence ratios clipped, OFF_POLICY's bounds): loss, gradients and the clip ratios
    equal RLOOTrainer's."""
    keys = {"beta": 0.0, **(OFF_POLICY if off_policy else {})}
    theirs = trl_rloo(checkpoints, tokenizer, tmp_path, off_policy, **keys)
    mine = rloo_ours(native, rloo_batch(theirs.old_logps if off_policy else None), **keys)
    assert mine.count == N
    if off_policy:  # whole-sequence ratios of a checkpoint this far: some fall below 1 - epsilon, none above
        assert theirs.metrics["clip_ratio/low_mean"] > 0, theirs.metrics
        assert mine.metrics["clip_ratio/high_mean"] == theirs.metrics["clip_ratio/high_mean"] == 0.0
    else:  # at ratio 1 the loss is Σ -A, 0 by construction (a group's leave-one-out advantages sum to 0): both ~0,
        # so the gradients (the policy gradient itself) carry the check
        assert abs(mine.loss) < 1e-6 and abs(theirs.loss) < 1e-6
        mine, theirs = replace(mine, loss=1.0), replace(theirs, loss=1.0)
        assert all(mine.metrics[k] == theirs.metrics[k] == 0.0 for k in CLIP_METRICS)  # nothing clipped at ratio 1
    assert_matches(mine, theirs, names=("clip_ratio/low_mean", "clip_ratio/region_mean") if off_policy else ())


@pytest.mark.parametrize("name", ["rloo", "grpo"])
def test_a_lagging_rollout_is_corrected_in_one_pass(checkpoints, tokenizer, native, tmp_path, name):
    """``max_staleness: 1`` with the sampler's log-probs as the old policy's and one pass (no ``old_logps`` in the
    batch): the batch's sampler log-probs are the old checkpoint's (a stale sampler, far from the policy), and the
    one-pass loss, gradients and clip ratios equal TRL's trainer given that checkpoint's log-probs as the old ones
    (RLOO's sequence ratio, GRPO's token ratio with importance_sampling off). A step that ignored the lag (ratio 1:
    the mutation ``lag_corrected=False``) gives a loss TRL's is far from."""
    keys = {"beta": 0.0, **OFF_POLICY}
    if name == "rloo":
        theirs = trl_rloo(checkpoints, tokenizer, tmp_path, True, **keys)
        cfg = rloo_cfg(**keys, max_staleness=1, old_logps="sampler")
        batch = {**our_batch(sampler_logps=theirs.old_logps), "advantages": RLOO_ADVANTAGES}
    else:
        keys["loss_type"] = "dapo"
        theirs = trl_grpo(checkpoints, tokenizer, tmp_path, off_policy=True, **keys)
        cfg = objective_config(name="grpo", rewards=[{"name": "length"}], num_generations=GROUP,
                               max_completion_length=MAX_COMPLETION, max_staleness=1, old_logps="sampler",
                               importance_sampling="off", **keys)
        batch = our_batch(sampler_logps=theirs.old_logps)
    objective = replace(make_objective(cfg), passes=1)
    assert objective.lag_corrected and "old_logps" not in batch
    means = lambda metrics, count: {k: float(v) for k, v in per_unit(metrics, count).items()}
    mine = trl_reference.objective_result(native, objective, cfg, native.policy, batch, means)
    assert mine.metrics["clip_ratio/region_mean"] > 0, mine.metrics  # the stale ratios moved off 1: some clipped
    assert_matches(mine, theirs, names=("clip_ratio/low_mean", "clip_ratio/region_mean"))
    ignored = trl_reference.objective_result(native, replace(objective, lag_corrected=False), cfg, native.policy,
                                             batch, means)
    assert abs(ignored.loss - theirs.loss) > 100 * TOL * abs(theirs.loss), (ignored.loss, theirs.loss)
    assert ignored.metrics["clip_ratio/region_mean"] == 0.0  # at ratio 1 nothing is clipped


@pytest.fixture(scope="module")
def old_params(checkpoints):
    """The "old" checkpoint's params (the policy plus more noise), read as the policy's are."""
    return trl_reference.tiny_spec(checkpoints["old"], *GRPO_RUN)[1].init(0).params


@pytest.mark.parametrize("beta, normalize", [(0.05, False), (0.05, True), (0.0, True)])
def test_rloo_advantages_match_trl(native, old_params, beta, normalize):
    """`leave_one_out_advantages` on the host, then `RLOO.prepare` on the whole batch (the KL to the reference in
    the reward, the normalisation), with one completion unscorable (every reward None): the advantages of
    RLOOTrainer's formulas on the same rewards and KL (the old checkpoint's log-probs against the reference's)."""
    rewards = list(REWARDS)
    rewards[2] = float("nan")  # unscorable: left out of its group's baselines, advantage 0
    host = leave_one_out_advantages(np.array(rewards), np.array(rewards)[:, None], GROUP)
    assert np.isnan(host[2]) and np.isfinite(np.delete(host, 2)).all()
    rows = {k: v for k, v in our_batch().items() if k in ("inputs", "targets", "positions", "segment_ids")}
    forward = native.spec.forward()
    with sharding.use_mesh(MESH):
        old = np.asarray(jax.jit(forward.token_logps)(old_params, rows))
        ref = np.asarray(jax.jit(forward.token_logps)(native.ref, rows))
    mask = our_batch()["loss_mask"]
    kl = ((old - ref) * mask).sum(-1)
    batch = {**our_batch(sampler_logps=old), "advantages": host}
    reference = Reference(lambda rows, temperature=1.0: forward.token_logps(native.ref, rows, None, temperature),
                          jnp.bool_(False))
    objective = make_objective(rloo_cfg(beta=beta, normalize_advantages=normalize, old_logps="sampler"))
    assert isinstance(objective, RLOO) and objective.old_from_sampler
    with sharding.use_mesh(MESH):
        prepared = objective.prepare(forward, native.policy, jax.tree.map(jnp.asarray, batch), reference)
    expected = trl_rloo_advantages(rewards, kl, beta, normalize)
    assert rel(np.asarray(prepared["advantages"]), expected) <= TOL, (prepared["advantages"], expected)
    assert prepared["advantages"][2] == 0.0


# ---------------------------------------------------------------------------------------------------- REINFORCE++


def reinforce_pp_cfg(**keys) -> ObjectiveConfig:
    return objective_config(name="reinforce_pp", rewards=[{"name": "length"}], num_generations=GROUP,
                            max_completion_length=MAX_COMPLETION, **keys)


def test_reinforce_pp_baseline_is_the_batchs_by_hand():
    """`ReinforcePP.advantages` on REWARDS with one completion unscorable (every function declined): each reward
    less the mean of the batch's 7 scorable ones, over their Bessel-corrected std + 1e-4, written out here; the
    unscorable one 0. The second group's rewards all agree, so a group baseline (GRPO's) gives it 0 and this one
    does not; a group of one (num_generations 1) is a batch like any other."""
    per_function = np.array(REWARDS)[:, None].copy()
    per_function[2] = np.nan
    total = np.nan_to_num(per_function[:, 0])
    rewarded = Rewarded(per_function, total, per_function[:, 0], np.ones(1), GROUP)
    scored = np.delete(np.array(REWARDS), 2)
    mean = sum(scored) / 7
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / 6)
    expected = [(r - mean) / (std + 1e-4) for r in REWARDS]
    expected[2] = 0.0
    for group in (GROUP, 1):
        adv, zero_std = ReinforcePP.advantages(reinforce_pp_cfg(), replace(rewarded, group=group))
        assert rel(adv, np.array(expected, np.float32)) <= 1e-6, (adv, expected)
        assert not zero_std.any()
    assert np.abs(adv[GROUP:]).min() > 0.1  # GRPO's group baseline: 0 for the second group
    assert np.all(group_advantages(per_function[:, 0], GROUP)[0][GROUP:] == 0.0)


@pytest.mark.parametrize("old_from", ["passes", "lagged"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_reinforce_pp_loss_is_ppos_clipped_token_mean_by_hand(native, old_params, beta, old_from):
    """REINFORCE++'s loss on the old checkpoint's completions (some ratios clipped both ways): the mean over every
    completion token of -min(r A, clip(r, 0.8, 1.28) A) + beta k3, with r = exp(logp - old), written out here in
    numpy from the policy's, the old checkpoint's and the reference's log-probs; its clip ratios and kl likewise.
    The old policy is the batch's ``old_logps`` (several passes) or, with ``max_staleness: 1`` and one pass, the
    sampler's log-probs (a lagged rollout). Its loss and gradients equal GRPO's dapo token mean without the KL's
    ratio weight and without importance sampling, which is checked against TRL above."""
    rows = {k: v for k, v in our_batch().items() if k in ("inputs", "targets", "positions", "segment_ids")}
    forward = native.spec.forward()
    with sharding.use_mesh(MESH):
        logp, old, ref = (np.asarray(jax.jit(forward.token_logps)(p, rows), np.float64)
                          for p in (native.policy, old_params, native.ref))
    mask = our_batch()["loss_mask"]
    adv = ADVANTAGES[:, None].astype(np.float64)
    r = np.exp(logp - old)
    surrogate = -np.minimum(r * adv, np.clip(r, 0.8, 1.28) * adv)
    kl = np.exp(ref - logp) - (ref - logp) - 1.0
    expected = ((surrogate + beta * kl) * mask).sum() / mask.sum()
    keys = {"beta": beta, **OFF_POLICY}
    if old_from == "passes":
        cfg, batch = reinforce_pp_cfg(**keys), our_batch(old_logps=old.astype(np.float32))
    else:
        cfg = reinforce_pp_cfg(**keys, max_staleness=1, old_logps="sampler")
        batch = our_batch(sampler_logps=old.astype(np.float32))
    objective = replace(make_objective(cfg), passes=1)
    assert isinstance(objective, ReinforcePP) and cfg.uses_reference == (beta > 0)
    means = lambda metrics, count: {k: float(v) for k, v in per_unit(metrics, count).items()}
    mine = trl_reference.objective_result(native, objective, cfg, native.policy, batch, means)
    assert rel(mine.loss, expected) <= TOL, (mine.loss, expected)
    low, high = (r < 0.8) & (adv < 0), (r > 1.28) & (adv > 0)
    assert low[mask > 0].any() and high[mask > 0].any()
    for name, hit in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high)):
        assert mine.metrics[name] == pytest.approx((hit * mask).sum() / mask.sum(), abs=1e-7), name
    assert mine.metrics["kl"] == pytest.approx(beta and (kl * mask).sum() / mask.sum(), rel=TOL)
    unweighted = {"use_bias_correction_kl": False} if beta else {}
    grpo_cfg = objective_cfg(loss_type="dapo", importance_sampling="off", **unweighted, **keys)
    grpo = trl_reference.objective_result(native, replace(make_objective(grpo_cfg), passes=1), grpo_cfg,
                                          native.policy, our_batch(old_logps=old.astype(np.float32)), means)
    assert rel(mine.loss, grpo.loss) <= 1e-6
    for g, h in zip(jax.tree.leaves(mine.grads), jax.tree.leaves(grpo.grads), strict=True):
        assert rel(g, h) <= 1e-5


@pytest.mark.parametrize("keys, message", [
    ({"num_generations": 1, "prompts_per_step": 1}, "a step needs 2 completions or more"),
    ({"dynamic_sampling": True}, "drop dynamic_sampling"),
])
def test_reinforce_pp_refuses_what_a_batch_baseline_cannot_use(keys, message):
    """One completion a step has no std to scale by, and dynamic sampling's filter (groups whose rewards agree) is a
    group baseline's: each is one line at load time. One completion per prompt over two prompts is a batch."""
    base = ["objective.name=reinforce_pp", "data.format=prompts", "objective.rewards=[{name: length}]"]
    with pytest.raises(ValueError, match=message) as raised:
        load_config(None, base + [f"objective.{k}={str(v).lower()}" for k, v in keys.items()])
    assert "\n" not in str(raised.value).split("Value error, ")[-1].strip(), raised.value
    cfg = load_config(None, base + ["objective.num_generations=1", "objective.prompts_per_step=2"])
    assert cfg.objective.spec.baseline == "batch"

"""On-policy distillation: TRL's GKD (generalised knowledge distillation, arXiv 2306.13649).

The rows are GRPO's (`jaxtune.rollout.rollout`): a prompt and a completion the student sampled (on-policy), or, on the
share ``1 - lmbda`` of steps, the prompt row's own completion (supervised distillation); no rewards enter the loss.
A frozen teacher model (`jaxtune.train.reference.ReferenceModel` with ``teacher``) scores every row in the step,
and the loss at each completion token is the generalised Jensen-Shannon divergence of the student's next-token
distribution S and the teacher's T over the whole vocabulary, with M = (1 - beta) S + beta T:

    JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M);  beta 0: KL(T || S);  beta 1: KL(S || T) (the reverse KL)

averaged over the batch's completion tokens (TRL's ``generalized_jsd_loss`` with its ``batchmean`` over the labelled
tokens, at temperature 1 as TRL's ``compute_loss`` calls it). Metrics: ``teacher_logp`` and ``student_logp``, the
mean log-prob each model gives the completion tokens (the student's rising towards the teacher's is distillation
working).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.train.objectives.advantages import Rewarded, zero_advantages
from jaxtune.train.objectives.base import BetaOnly, Metrics, Reference
from jaxtune.train.objectives.policy_gradient import rows as row_arrays
from jaxtune.train.state import Batch, Forward


def generalized_jsd(student: jax.Array, teacher: jax.Array, beta: float) -> jax.Array:
    """Per position, (..., V) log-probs -> (...): the generalised JSD of the two distributions (see the module)."""
    kl = lambda p, q: jnp.sum(jnp.exp(p) * (p - q), axis=-1)  # KL(P || Q) of log-probs
    if beta == 0.0:
        return kl(teacher, student)
    if beta == 1.0:
        return kl(student, teacher)
    mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
    return beta * kl(teacher, mixture) + (1.0 - beta) * kl(student, mixture)


@dataclass(frozen=True)
class GKD(BetaOnly):
    name: str = "gkd"
    beta: float = 0.5
    metric_names: tuple[str, ...] = ("teacher_logp", "student_logp")
    passes: int = 1
    prepares: bool = False

    @staticmethod
    def advantages(cfg: Any, rewarded: Rewarded) -> tuple[Any, None]:
        """None: the teacher, not a reward, says how good a token is (the rewards are logged only)."""
        return zero_advantages(rewarded)

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        if reference is None or reference.log_softmax is None:
            raise ValueError("gkd needs the teacher model's distributions (objective.teacher)")
        rows = row_arrays(batch)
        student = jax.nn.log_softmax(forward.logits(weights, rows, key).astype(jnp.float32), axis=-1)
        teacher = jax.lax.stop_gradient(reference.log_softmax(rows))
        mask = batch["loss_mask"].astype(jnp.float32)
        per_token = generalized_jsd(student, teacher, self.beta)
        tokens = jnp.sum(mask)
        pick = lambda lp: jnp.sum(jnp.take_along_axis(lp, batch["targets"][..., None], -1)[..., 0] * mask)
        metrics: Metrics = {"teacher_logp": pick(teacher), "student_logp": jax.lax.stop_gradient(pick(student))}
        return jnp.sum(per_token * mask), tokens, metrics

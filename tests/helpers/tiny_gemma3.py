"""A tiny random Gemma 3 (`tiny_gemma`: seven layers, five sliding, one global, one sliding; head_dim 32 apart from
d_model / n_head = 16; window 8, shorter than `IDS`' 24 positions) with Gemma's kind of tokenizer (`tiny_tokenizer`:
SentencePiece's spelling, Gemma's special ids) and a chat template of Gemma's turns."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from helpers.tiny_hf import save_perturbed

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # Gemma's ids 0..3, then turns
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?", "user\nmodel\n"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
            "<start_of_turn>model\n{% endif %}")
IDS = np.random.default_rng(0).integers(0, 90, (2, 24))  # 24 positions: three windows of 8
HEAD_DIM = 32


def tiny_tokenizer():
    """A BPE over ▁-joined words (SentencePiece's spelling, no prefix space, as Gemma's), Gemma's special ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Replace("▁", " ")
    tok.train_from_iterator(TEXTS, trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS,
                                                               show_progress=False))
    return tok


def tiny_gemma(directory: Path, **config) -> Path:
    """A tiny random Gemma 3 (every tensor perturbed; Gemma's norms start at 0) saved to ``directory``."""
    import transformers

    vocab = tiny_tokenizer().get_vocab_size()
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
        max_position_embeddings=128, rope_theta=1e6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        attn_implementation="eager", **config)
    return save_perturbed(lambda: transformers.Gemma3ForCausalLM(cfg), directory)

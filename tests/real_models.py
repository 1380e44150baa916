"""Real Hugging Face ``transformers`` architectures built from small configs (no weights, no downloads).

:data:`FAMILIES` maps a family name to a builder; :func:`build` returns ``(model, inputs)`` where
``inputs`` is a dict of keyword tensors for ``model(**inputs)``; ``seq`` changes the sequence length
(or image size) so a second call exercises a dynamic-shape recompile.  :func:`loss_of` turns an
output into a scalar for a training step.  Used by the real-model tests and ``scripts/corpus.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["FAMILIES", "build", "loss_of", "available"]

VOCAB = 128


def available() -> bool:
    """Whether ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _llama(T, seq):
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return T.LlamaForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _gpt2(T, seq):
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(cfg), {"input_ids": _ids(2, seq)}


def _bert(T, seq):
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=128)
    return T.BertForMaskedLM(cfg), {"input_ids": _ids(2, seq)}


def _t5(T, seq):
    cfg = T.T5Config(vocab_size=VOCAB, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                     feed_forward_proj="relu")
    ids = _ids(2, seq)
    return T.T5ForConditionalGeneration(cfg), {"input_ids": ids, "decoder_input_ids": ids[:, : max(2, seq // 2)]}


def _resnet(T, seq):
    cfg = T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                         layer_type="basic", num_labels=10)
    g = torch.Generator().manual_seed(1)
    return T.ResNetForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 2 * seq, 2 * seq, generator=g)}


FAMILIES: Dict[str, Callable[[Any, int], Tuple[torch.nn.Module, Dict[str, torch.Tensor]]]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "bert": _bert,
    "t5": _t5,
    "resnet": _resnet,
}


def build(family: str, seq: int = 16, seed: int = 0) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor]]:
    """A freshly initialized small model of ``family`` (seeded) and its keyword inputs."""
    import transformers as T

    torch.manual_seed(seed)
    model, inputs = FAMILIES[family](T, seq)
    return model, inputs


def loss_of(out: Any) -> torch.Tensor:
    """A scalar from a model output (logits, or the first tensor)."""
    t = getattr(out, "logits", None)
    if t is None:
        t = out[0] if isinstance(out, (tuple, list)) else out
    return t.float().pow(2).mean()

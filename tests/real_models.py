"""Real Hugging Face ``transformers`` architectures built from small configs (no weights, no downloads).

:data:`FAMILIES` maps a family name to a builder; :func:`build` returns ``(model, inputs)`` where
``inputs`` is a dict of keyword tensors for ``model(**inputs)``; ``seq`` changes the sequence length
(or image size, or audio length) so a second call exercises a dynamic-shape recompile.  :func:`loss_of`
turns an output into a scalar for a training step.  :data:`RELU_FAMILIES` (and :func:`has_relu`) name the
families whose forward computes an ``aten.relu`` (targets of inductor's injected relu bug).  Used by the
real-model tests and ``scripts/corpus.py``.

Each model is tiny (hidden size 64 or less, 2 layers or stages) so that an inductor compile stays quick.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["FAMILIES", "RELU_FAMILIES", "build", "loss_of", "first_tensor", "available", "has_relu"]

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


def _pixels(channels: int, size: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, channels, size, size, generator=g)


def _opt(T, seq):  # pre-LayerNorm decoder, learned positions, relu FFN
    cfg = T.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                      word_embed_proj_dim=64, max_position_embeddings=128, activation_function="relu",
                      pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return T.OPTForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _mistral(T, seq):  # RMSNorm, rotary, grouped-query attention, SiLU-gated FFN, sliding window
    cfg = T.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=8)
    return T.MistralForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _qwen2(T, seq):  # RMSNorm, rotary, GQA with biased q/k/v projections
    cfg = T.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return T.Qwen2ForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _phi(T, seq):  # parallel attention + MLP, partial rotary, gelu_new
    cfg = T.PhiConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128)
    return T.PhiForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _gpt_neox(T, seq):  # parallel residual, fused qkv, rotary
    cfg = T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=128)
    return T.GPTNeoXForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _distilbert(T, seq):  # encoder without token types, gelu
    cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=128)
    return T.DistilBertForMaskedLM(cfg), {"input_ids": _ids(2, seq)}


def _roberta(T, seq):  # encoder, padding-offset positions
    cfg = T.RobertaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=130, pad_token_id=1)
    ids = _ids(2, seq).clamp(min=3)  # no padding token: every position counts
    return T.RobertaForMaskedLM(cfg), {"input_ids": ids}


def _bart(T, seq):  # encoder-decoder with cross-attention, gelu
    cfg = T.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
                       max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, forced_eos_token_id=2)
    ids = _ids(2, seq).clamp(min=3)
    return T.BartForConditionalGeneration(cfg), {"input_ids": ids, "decoder_input_ids": ids[:, : max(2, seq // 2)]}


def _vit(T, seq):  # patch embedding (conv), pre-LN encoder, CLS pooling
    size = 2 * seq
    cfg = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      image_size=size, patch_size=8, num_channels=3, num_labels=10)
    return T.ViTForImageClassification(cfg), {"pixel_values": _pixels(3, size)}


def _convnext(T, seq):  # depthwise 7x7 conv, channels-last LayerNorm, layer scale, gelu
    cfg = T.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                           num_labels=10)
    return T.ConvNextForImageClassification(cfg), {"pixel_values": _pixels(3, 2 * seq)}


def _mobilenet_v2(T, seq):  # inverted residuals, depthwise conv, batch norm, relu6
    cfg = T.MobileNetV2Config(num_channels=3, image_size=2 * seq, depth_multiplier=0.25, num_labels=10)
    return T.MobileNetV2ForImageClassification(cfg), {"pixel_values": _pixels(3, 2 * seq)}


def _whisper(T, seq):  # conv front end over log-mel frames, encoder-decoder
    cfg = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_source_positions=seq, max_target_positions=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 16, 2 * seq, generator=g)  # the encoder expects 2 * max_source_positions frames
    return T.WhisperForConditionalGeneration(cfg), {"input_features": feats, "decoder_input_ids": _ids(2, max(2, seq // 2)) % 64}


def _wav2vec2(T, seq):  # strided conv feature extractor with group norm, convolutional positions (weight norm)
    cfg = T.Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                           num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.0,
                           apply_spec_augment=False)
    g = torch.Generator().manual_seed(1)
    return T.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(2, 40 * seq, generator=g)}


def _mixtral(T, seq):  # sparse MoE FFN: top-2 router over 4 SiLU-gated experts, GQA, rotary
    cfg = T.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          num_local_experts=4, num_experts_per_tok=2)
    return T.MixtralForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _qwen2_moe(T, seq):  # MoE with top-k routed experts plus a sigmoid-gated shared expert, biased q/k/v
    cfg = T.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                           num_experts_per_tok=2)
    return T.Qwen2MoeForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _gemma2(T, seq):  # attention and final logit soft-capping (tanh), alternating sliding/global layers, sandwich norms
    cfg = T.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         max_position_embeddings=128, sliding_window=8)
    return T.Gemma2ForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _falcon(T, seq):  # new decoder architecture: parallel attention + MLP with two layer norms, GQA, rotary
    cfg = T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                         new_decoder_architecture=True, alibi=False, max_position_embeddings=128)
    return T.FalconForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _bloom(T, seq):  # ALiBi position bias (no position embeddings), embedding layer norm, fused qkv
    cfg = T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    return T.BloomForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _gptj(T, seq):  # parallel attention + MLP sharing one layer norm, interleaved partial rotary, biased LM head
    cfg = T.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=128, n_positions=128,
                       bos_token_id=0, eos_token_id=0)
    return T.GPTJForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _mpt(T, seq):  # ALiBi attention, bias-free linears and layer norms, no position embeddings
    cfg = T.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=128)
    return T.MptForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _starcoder2(T, seq):  # LayerNorm with biases, GQA, rotary, ungated gelu FFN, sliding window
    cfg = T.Starcoder2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=8,
                             bos_token_id=0, eos_token_id=0)
    return T.Starcoder2ForCausalLM(cfg), {"input_ids": _ids(2, seq)}


def _deberta_v2(T, seq):  # disentangled attention: content-to-position and position-to-content relative terms
    cfg = T.DebertaV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=128, type_vocab_size=0,
                            relative_attention=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                            max_relative_positions=-1, pad_token_id=0)
    return T.DebertaV2ForMaskedLM(cfg), {"input_ids": _ids(2, seq).clamp(min=1)}


def _electra(T, seq):  # discriminator: factorized embedding projection, replaced-token-detection head
    cfg = T.ElectraConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    return T.ElectraForPreTraining(cfg), {"input_ids": _ids(2, seq)}


def _albert(T, seq):  # one layer group shared by every layer, factorized embeddings (32 -> 64)
    cfg = T.AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_hidden_groups=1, num_attention_heads=4, max_position_embeddings=128)
    return T.AlbertForMaskedLM(cfg), {"input_ids": _ids(2, seq)}


def _swin(T, seq):  # windowed attention with shifted windows (roll + mask), relative position bias, patch merging
    size = 2 * seq
    cfg = T.SwinConfig(image_size=size, patch_size=2, num_channels=3, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                       window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, num_labels=10)
    return T.SwinForImageClassification(cfg), {"pixel_values": _pixels(3, size)}


def _segformer(T, seq):  # spatial-reduction attention, mix-FFN (depthwise conv), all-MLP decode head with relu
    cfg = T.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
                            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[2, 4], mlp_ratios=[2, 2],
                            decoder_hidden_size=64, drop_path_rate=0.0, num_labels=4)
    return T.SegformerForSemanticSegmentation(cfg), {"pixel_values": _pixels(3, 2 * seq)}


def _clip(T, seq):  # two towers (causal text, ViT vision), projections, learned logit scale, image-text logits
    size = 2 * seq
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_channels=3,
                  image_size=size, patch_size=8)
    cfg = T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    return T.CLIPModel(cfg), {"input_ids": _ids(2, seq), "pixel_values": _pixels(3, size)}


def _mbart(T, seq):  # encoder-decoder, pre-LayerNorm with final encoder/decoder LayerNorms, offset learned positions
    cfg = T.MBartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
                        max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=2)
    ids = _ids(2, seq).clamp(min=3)
    return T.MBartForConditionalGeneration(cfg), {"input_ids": ids, "decoder_input_ids": ids[:, : max(2, seq // 2)]}


def _mamba(T, seq):  # selective state space scan (pure-torch path), causal depthwise conv1d, no attention
    cfg = T.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
                        use_mambapy=False, use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return T.MambaForCausalLM(cfg), {"input_ids": _ids(2, seq)}



FAMILIES: Dict[str, Callable[[Any, int], Tuple[torch.nn.Module, Dict[str, torch.Tensor]]]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "bert": _bert,
    "t5": _t5,
    "resnet": _resnet,
    "opt": _opt,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "phi": _phi,
    "gpt_neox": _gpt_neox,
    "distilbert": _distilbert,
    "roberta": _roberta,
    "bart": _bart,
    "vit": _vit,
    "convnext": _convnext,
    "mobilenet_v2": _mobilenet_v2,
    "whisper": _whisper,
    "wav2vec2": _wav2vec2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "gemma2": _gemma2,
    "falcon": _falcon,
    "bloom": _bloom,
    "gptj": _gptj,
    "mpt": _mpt,
    "starcoder2": _starcoder2,
    "deberta_v2": _deberta_v2,
    "electra": _electra,
    "albert": _albert,
    "swin": _swin,
    "segformer": _segformer,
    "clip": _clip,
    "mbart": _mbart,
    "mamba": _mamba,
}

#: Families whose forward computes ``aten.relu`` (T5's relu FFN, OPT's relu FFN, ResNet's ReLUs): where
#: ``torch._inductor.config.cpp.inject_relu_bug_TESTING_ONLY`` plants a bug whose root cause is a ``relu`` node.
#: MobileNetV2's ``relu6`` is a ``hardtanh``, not a relu; SegFormer's decode head fuses its stages with a ReLU.
RELU_FAMILIES = frozenset({"t5", "resnet", "opt", "segformer"})


def has_relu(family: str) -> bool:
    """Whether ``family``'s forward contains a ``relu`` (see :data:`RELU_FAMILIES`)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family in RELU_FAMILIES


def build(family: str, seq: int = 16, seed: int = 0, **config: Any) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor]]:
    """A freshly initialized small model of ``family`` (seeded) and its keyword inputs; ``config`` overrides
    fields of its ``transformers`` config (``hidden_act="relu"``)."""
    import transformers as T

    torch.manual_seed(seed)
    model, inputs = FAMILIES[family](_Overridden(T, config) if config else T, seq)
    return model, inputs


class _Overridden:
    """The ``transformers`` module with ``config`` applied to every ``*Config`` class a builder makes."""

    def __init__(self, module: Any, config: Dict[str, Any]):
        self._module, self._config = module, config

    def __getattr__(self, name: str) -> Any:
        obj = getattr(self._module, name)
        if not name.endswith("Config"):
            return obj
        return lambda *args, **kwargs: obj(*args, **{**kwargs, **self._config})


def loss_of(out: Any) -> torch.Tensor:
    """A scalar from a model output (logits, or the first tensor)."""
    return first_tensor(out).float().pow(2).mean()


def first_tensor(out: Any) -> torch.Tensor:
    """A model output's logits, or its first tensor (a tuple's, or a ModelOutput's such as CLIP's)."""
    t = getattr(out, "logits", None)
    if t is None and hasattr(out, "to_tuple"):  # a ModelOutput without .logits (CLIPOutput: logits_per_image first)
        t = out.to_tuple()[0]
    if t is None:
        t = out[0] if isinstance(out, (tuple, list)) else out
    return t

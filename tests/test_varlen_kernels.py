"""The CUDA call paths of packer_varlen (flash_attn_varlen_func, torch varlen_attn), checked on CPU.

No GPU runs the kernels here, so each is replaced by a reference implementation of its documented
semantics with the same signature (a textbook softmax attention per segment, not SDPA):

- flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, ...):
  q/k/v (total, heads, headdim), cu_seqlens int32; softmax_scale defaults to 1/sqrt(headdim); "query
  at position i will only attend to keys between [i + seqlen_k - seqlen_q - window_size[0],
  i + seqlen_k - seqlen_q + window_size[1]] inclusive"; causal aligned bottom-right; GQA by fewer kv heads.
- torch.nn.attention.varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
  scale=None, window_size=(-1, -1), enable_gqa=False, ...): no causal flag: "(-1, 0) for causal
  attention", (W, 0) a causal window; kv heads fewer than q heads only with enable_gqa.

A model prepared with the path forced on must give each packed example the logits it has alone through
eager attention, and the kernel must receive exactly what its documentation asks for. Where CUDA (and
flash-attn) is present, the same test runs the real kernels in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig

import packer.training.attention as attention
import packer.training.guard as guard
from packer.errors import ConfigError

VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**SMALL),
    "mistral-window-4": lambda: MistralConfig(**SMALL, sliding_window=4),
    "gemma3-query_pre_attn_scalar": lambda: Gemma3TextConfig(**SMALL, query_pre_attn_scalar=64, sliding_window=4),
}
CALLS: list[dict] = []


def _segment_attention(q, k, v, scale, left, right, causal, softcap):
    """Textbook softmax attention of one segment, q (Lq, H, D), k/v (Lk, Hk, D), documented window."""
    lq, lk = q.shape[0], k.shape[0]
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def _check_cu(q, k, cu_q, cu_k, max_q, max_k):
    assert q.dim() == 3 and k.dim() == 3, "q/k/v are (total_tokens, heads, headdim)"
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, "cu_seqlens are int32"
    assert type(max_q) is int and type(max_k) is int, "max lengths are Python ints (no device sync)"
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]


def _run_segments(q, k, v, cu_q, cu_k, **how):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return torch.cat([
        _segment_attention(q[bq[s] : bq[s + 1]], k[bk[s] : bk[s + 1]], v[bk[s] : bk[s + 1]], **how)
        for s in range(len(bq) - 1)
    ])  # fmt: skip


def reference_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    _check_cu(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert dropout_p == 0.0 and alibi_slopes is None and block_table is None
    CALLS.append(dict(kernel="flash", softmax_scale=softmax_scale, causal=causal, window_size=window_size))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = window_size
    return _run_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, left=left, right=right,
                         causal=causal, softcap=softcap)  # fmt: skip


def reference_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    _check_cu(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
    assert enable_gqa == (key.shape[1] != query.shape[1]), "fewer kv heads only with enable_gqa"
    assert seqused_k is None and block_table is None and return_aux is None
    CALLS.append(dict(kernel="varlen", scale=scale, window_size=window_size))
    left, right = window_size
    return _run_segments(query, key, value, cu_seq_q, cu_seq_k, left=left, right=right, causal=False, softcap=0.0,
                         scale=scale if scale is not None else query.shape[-1] ** -0.5)  # fmt: skip


def _has_real(backend: str) -> bool:
    if not torch.cuda.is_available():
        return False
    if backend == "flash_attn":
        return attention._HAS_FLASH_ATTN
    return attention._varlen_attn() is not None


@pytest.fixture(params=["flash_attn", "varlen_attn"])
def backend(request, monkeypatch):
    monkeypatch.setattr(attention, "backend_for", lambda query, dropout=0.0: request.param)
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", lambda: reference_flash_attn_varlen_func)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: reference_varlen_attn)
    CALLS.clear()
    return request.param


def _packed_vs_alone(model, device, lens=(9, 3, 7)):
    gen = torch.Generator().manual_seed(0)
    exs = [torch.randint(1, VOCAB, (n,), generator=gen).to(device) for n in lens]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        alone = [model(input_ids=e.view(1, -1), use_cache=False).logits[0].float() for e in exs]
        guard.prepare(model)
        packed = model(**guard._row(exs)).logits[0].float().split(list(lens))
    scale = max(a.abs().max().item() for a in alone)
    diff = max((p - a).abs().max().item() for p, a in zip(packed, alone, strict=True))
    return diff, scale


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_call_path_gives_each_example_its_logits_alone(backend, name):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    diff, scale = _packed_vs_alone(model, "cpu")
    assert diff <= guard.PROBE_TOLERANCE * scale
    assert CALLS, "the kernel path ran"
    attn = model.model.layers[0].self_attn
    window = getattr(model.config, "sliding_window", None)
    for call in CALLS:
        if backend == "flash_attn":
            assert call["causal"] is True and call["softmax_scale"] == attn.scaling
            assert call["window_size"] in ({(-1, -1)} if not window else {(-1, -1), (window - 1, 0)})
        else:
            assert call["scale"] == attn.scaling
            assert call["window_size"] in ({(-1, 0)} if not window else {(-1, 0), (window - 1, 0)})
    if window:  # the windowed layers passed W-1 to the left: a token sees itself and W-1 before it
        assert any(c["window_size"] == (window - 1, 0) for c in CALLS)


def test_soft_capping_is_refused_on_every_kernel_path(backend):
    q = torch.randn(1, 4, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ConfigError, match="soft-capping / sinks are not supported"):
        attention.packed_attention(module, q, q, q, None, softcap=30.0, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                   max_length_q=4, max_length_k=4)  # fmt: skip
    assert not CALLS


@pytest.mark.parametrize("real", ["flash_attn", "varlen_attn"])
def test_real_kernels_when_cuda_is_present(real, monkeypatch):
    if not _has_real(real):
        pytest.skip(f"{real} needs CUDA (and flash-attn for flash_attn)")
    monkeypatch.setattr(attention, "backend_for", lambda query, dropout=0.0: real)
    for name in CONFIGS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.bfloat16).to("cuda").eval()
        diff, scale = _packed_vs_alone(model, "cuda")
        assert diff <= math.sqrt(torch.finfo(torch.bfloat16).eps) * scale, name

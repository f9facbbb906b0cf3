"""The Llama-family network (Llama 2/3, Qwen2, Mistral, SmolLM2) with a paged KV cache, in MindSpore
GRAPH mode: built on the AOT kernels of ``backends.mindspore.kernels`` where they build, else on stock ops.

One ``construct`` serves prefill chunks and decode steps: tokens are written into the cache first,
then attend through it, so the graph depends only on the shapes (batch, tokens, and, for the stock-op
path, the attention window).
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from backends.mindspore.spec import ModelSpec
from backends.mindspore.yaml_tree import DEVICE_TARGETS, ConfigError
from backends.mindspore.quant import QuantWeight, concat_rows


DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def _param(array: np.ndarray | QuantWeight, name: str, dtype=ms.float32) -> Parameter:
    if isinstance(array, QuantWeight):  # the embedding of a quantized conversion: dequantized once
        array = array.dequantize()
    return Parameter(Tensor(np.ascontiguousarray(array, dtype=np.float32), dtype), name=name, requires_grad=False)


def _weight(parts: list[np.ndarray | QuantWeight], name: str, fast: bool, dtype=ms.float32) -> Parameter:
    """A matmul weight from HF [out, in] matrices stacked along their outputs (q, k, v -> qkv). For the AOT
    kernels: GGUF blocks of one format stay quantized (prepare_qweight), else float32 in the kernel's packed
    layout; for MatMul: [in, out] float32 (blocks dequantized once, here)."""
    if fast and all(isinstance(p, QuantWeight) for p in parts) and len({p.fmt for p in parts}) == 1:
        from backends.mindspore.kernels import prepare_qweight

        packed = prepare_qweight(concat_rows(parts))
        return Parameter(Tensor(packed, ms.uint8), name=name, requires_grad=False)
    array = np.concatenate([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts], axis=0).T
    if fast:
        from backends.mindspore.kernels import prepare_weight

        array = prepare_weight(array)
    return _param(array, name, dtype)


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_pos, head_dim] in HF ``rotate_half`` layout (frequencies repeated over both halves)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_pos, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RMSNorm(nn.Cell):
    def __init__(self, weight: np.ndarray, eps: float, name: str, aot=None, dtype=ms.float32) -> None:
        super().__init__()
        self.weight = _param(weight, name, dtype)
        self.eps = eps
        self.aot = aot
        self.eps_t = Tensor(np.array([eps], np.float32))
        self.dtype, self.low_precision = dtype, dtype != ms.float32

    def construct(self, x):
        if self.aot is not None:
            return self.aot.rmsnorm(x, self.weight, self.eps_t)
        if self.low_precision:  # the mean of squares in float32: float16 overflows past 256
            x32 = ops.cast(x, ms.float32)
            normed = x32 * ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + self.eps)
            return ops.cast(normed, self.dtype) * self.weight
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps) * self.weight


class DecoderLayer(nn.Cell):
    """Attention + MLP for one layer; owns the layer's K/V cache ``[kv_heads * num_slots, head_dim]``.

    With the AOT kernels (``aot``, an ``AotOps``) a layer is one op (``decoder_layer``); with adapter slots
    it is 5: norm + qkv matmul, attention (bias, split + rotary, the in-place cache writes and paged
    attention in one kernel), o matmul + residual, norm + gate/up matmul, SwiGLU + down matmul + residual
    (the one op runs those five kernels in that order: the same bits). Without the AOT kernels it is the
    same maths in stock MindSpore ops, attending over a gathered window with an additive mask.
    """

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], i: int, num_slots: int, block_size: int,
                 aot=None, dtype=ms.float32, lora: tuple[int, int] | None = None) -> None:
        super().__init__()
        p = f"model.layers.{i}."
        self.aot = aot
        self.fused = aot is not None
        self.attn_meta = Tensor(np.array([spec.num_kv_heads, block_size, int(spec.qkv_has_bias)], np.int32))
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q, k, v = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        # Fused (q, k, v rows stacked), stored [in, out] so a plain matmul streams it, or packed for the AOT kernels.
        self.wqkv = _weight([q, k, v], p + "wqkv", self.fused, dtype)
        self.has_bias = spec.qkv_has_bias
        if self.has_bias:
            bias = np.concatenate([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            self.bqkv = _param(bias, p + "bqkv", dtype)
        self.wo = _weight([w[p + "self_attn.o_proj.weight"]], p + "wo", self.fused, dtype)
        self.w_gate_up = _weight([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], p + "w_gate_up",
                                 self.fused, dtype)
        self.w_down = _weight([w[p + "mlp.down_proj.weight"]], p + "w_down", self.fused, dtype)
        self.ffn = spec.intermediate_size
        self.attn_norm = RMSNorm(w[p + "input_layernorm.weight"], spec.rms_norm_eps, p + "attn_norm", aot, dtype)
        self.ffn_norm = RMSNorm(w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps, p + "ffn_norm", aot,
                                dtype)
        # Row kv_head * num_slots + slot holds one head's K (or V) of one token. 2-D, so ScatterUpdate
        # writes it in place (ScatterNdUpdate, or any reshape of the Parameter, copies the whole cache);
        # kv-head-major, so a gather of rows is already the [kv, B, W, D] the ops path multiplies. The AOT
        # attention kernel writes the same rows itself, through the Parameter's own memory.
        cache_shape = (spec.num_kv_heads * num_slots, spec.head_dim)
        self.k_cache = _param(np.zeros(cache_shape, np.float32), p + "k_cache", dtype)
        self.v_cache = _param(np.zeros(cache_shape, np.float32), p + "v_cache", dtype)
        self.scatter = ops.ScatterUpdate()
        if not self.has_bias:  # the AOT attention kernel's bias input, never read (attn_meta says there is none)
            self.bqkv = Tensor(np.zeros(1, np.float32))
        self.bmm = ops.BatchMatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.scale = 1.0 / float(np.sqrt(spec.head_dim))
        self.lora = lora is not None
        if self.lora:
            self._lora_params(spec, p, *lora, dtype)
        else:  # construct passes them along, unused
            for group in ("qkv", "o", "gate_up", "down"):
                for part in ("a", "b", "segs", "cols"):
                    setattr(self, f"lora_{group}_{part}", None)

    def _lora_params(self, spec: ModelSpec, p: str, slots: int, rank: int, dtype) -> None:
        """Adapter slots (lora_slots.py): per group a [S, K, G*R] and b [S, R, N] (zeros until an adapter is
        loaded), the column boundaries of its projections, and (stock ops) the mask of each projection's
        columns [G, N]."""
        from backends.lora import BaseDims
        from backends.mindspore.lora_slots import GROUPS, group_segments, group_shapes

        dims = BaseDims.of(spec)
        for group in GROUPS:
            a_shape, b_shape = group_shapes(dims, group, slots, rank)
            setattr(self, f"lora_{group}_a", _param(np.zeros(a_shape, np.float32), p + f"lora_{group}_a", dtype))
            setattr(self, f"lora_{group}_b", _param(np.zeros(b_shape, np.float32), p + f"lora_{group}_b", dtype))
            segs = group_segments(dims, group)
            setattr(self, f"lora_{group}_segs", Tensor(np.array(segs, np.int32)))
            cols = np.zeros((len(segs) - 1, segs[-1]), np.float32)
            for g in range(len(segs) - 1):
                cols[g, segs[g]:segs[g + 1]] = 1
            setattr(self, f"lora_{group}_cols", Tensor(cols, dtype))
        self.lora_slot_ids = Tensor(np.arange(slots, dtype=np.int32))

    def _delta(self, x, a, b, cols, rows):
        """Stock ops: each row's LoRA delta [N, out] for x [N, K], its slot in rows [N] (-1: none, an exact
        zero). Every slot's shrink in one product, masked to the row's own slot, then one expand whose rows
        are each slot's b restricted to its projection's columns."""
        n = x.shape[0]
        s, k, gr = a.shape
        t = ops.matmul(x, ops.reshape(ops.transpose(a, (1, 0, 2)), (k, s * gr)))  # [N, S*GR]
        own = ops.cast(ops.equal(ops.expand_dims(rows, 1), ops.expand_dims(self.lora_slot_ids, 0)), x.dtype)
        t = ops.reshape(ops.reshape(t, (n, s, gr)) * ops.expand_dims(own, 2), (n, s * gr))
        expand = ops.expand_dims(b, 1) * ops.expand_dims(ops.expand_dims(cols, 0), 2)  # [S, G, R, N]
        return ops.matmul(t, ops.reshape(expand, (s * gr, -1)))

    def _mm(self, x, w, a, b, cols, rows):
        """Stock ops: x @ w, plus each row's LoRA delta (factors a, b of the group; cols its projections'
        columns; rows each row's slot) when the layer has adapter slots. (The AOT path's products are
        _norm_mm, _mm_add and _swiglu_mm_add.)"""
        y = ops.matmul(x, w)
        if self.lora:
            y = y + self._delta(x, a, b, cols, rows)
        return y

    def _norm_mm(self, norm, x, w, a, b, segs, rows):
        """norm(x) @ w (+ LoRA) in one AOT op."""
        if self.lora:
            return self.aot.norm_matmul_lora(x, norm.weight, norm.eps_t, w, a, b, rows, segs)
        return self.aot.norm_matmul(x, norm.weight, norm.eps_t, w)

    def _swiglu_mm_add(self, gate_up, w, res, a, b, segs, rows):
        """res + swiglu(gate_up) @ w (+ LoRA) in one AOT op."""
        if self.lora:
            return self.aot.swiglu_matmul_add_lora(gate_up, w, res, a, b, rows, segs)
        return self.aot.swiglu_matmul_add(gate_up, w, res)

    def _mm_add(self, x, w, res, a, b, segs, rows):
        """res + x @ w (+ LoRA): AOT only."""
        if self.lora:
            return self.aot.matmul_add_lora(x, w, res, a, b, rows, segs)
        return self.aot.matmul_add(x, w, res)

    def _rope(self, x, cos, sin):
        # x: [B, T, heads, D]; cos/sin: [B, T, 1, D]
        half = self.head_dim // 2
        rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin

    def _attention_aot(self, x, cos, sin, pos, write_idx, table, token_rows, lora_rows):
        """x [N, dim] (N = B*T), before the attention norm; cos/sin [N, D]; pos [N] or [B, T]; token_rows,
        lora_rows [N]; table [R, NB]. Returns [N, H*D] before the o projection."""
        qkv = self._norm_mm(self.attn_norm, x, self.wqkv, self.lora_qkv_a, self.lora_qkv_b, self.lora_qkv_segs,
                            lora_rows)
        # One kernel: bias, RoPE, this step's K/V rows written into the cache Parameters (their memory, in
        # place, before any key is read), then paged attention over them. Nothing else in the graph reads or
        # writes the caches, so no ordering between ops is involved; the next step's graph runs after
        # this one has returned its outputs.
        return self.aot.qkv_attention(qkv, self.bqkv, cos, sin, self.k_cache, self.v_cache, write_idx, table, pos,
                                      token_rows, self.attn_meta)

    def _attention_ops(self, x, cos, sin, write_idx, read_rows, mask, lora_rows):
        """x [B, T, dim]; cos/sin [B, T, 1, D]; read_rows [kv, B, W]; mask [B, 1, T, W]; lora_rows [B*T]."""
        b, t, _ = x.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        g = h // kvh
        qkv = self._mm(ops.reshape(x, (b * t, -1)), self.wqkv, self.lora_qkv_a, self.lora_qkv_b, self.lora_qkv_cols,
                       lora_rows)
        if self.has_bias:
            qkv = qkv + self.bqkv
        q = ops.reshape(qkv[:, : h * d], (b, t, h, d))
        k = ops.reshape(qkv[:, h * d: (h + kvh) * d], (b, t, kvh, d))
        v = ops.reshape(qkv[:, (h + kvh) * d:], (b * t * kvh, d))
        q = self._rope(q, cos, sin)
        k = ops.reshape(self._rope(k, cos, sin), (b * t * kvh, d))
        keys = ops.gather(self.scatter(self.k_cache, write_idx, k), read_rows, 0)  # [kv, B, W, D]
        values = ops.gather(self.scatter(self.v_cache, write_idx, v), read_rows, 0)
        # GQA without repeating K/V: group query heads under their kv head. q: [kv, B, G*T, D]
        q = ops.transpose(ops.reshape(q, (b, t, kvh, g, d)), (2, 0, 3, 1, 4))
        q = ops.reshape(q, (kvh, b, g * t, d))
        scores = self.bmm_t(q, keys) * self.scale  # [kv, B, G*T, W]
        scores = ops.reshape(scores, (kvh, b, g, t, -1)) + mask
        probs = ops.reshape(ops.softmax(scores, -1), (kvh, b, g * t, -1))
        out = self.bmm(probs, values)  # [kv, B, G*T, D]
        out = ops.transpose(ops.reshape(out, (kvh, b, g, t, d)), (1, 3, 0, 2, 4))
        return ops.reshape(out, (b * t, h * d))

    def construct(self, x, cos, sin, pos, write_idx, index, aux, lora_rows=None):
        """x [B*T, dim] with the AOT kernels (pos [B*T] or [B, T], index the table, aux each token's table row),
        else [B, T, dim] (index the read rows, aux the mask); lora_rows [B*T] each token's adapter slot (-1:
        none) when the layer has adapter slots; same shape out."""
        if self.fused and not self.lora:
            return self.aot.decoder_layer(x, self.attn_norm.weight, self.attn_norm.eps_t, self.wqkv, self.bqkv, cos, sin,
                                          self.k_cache, self.v_cache, write_idx, index, pos, aux, self.attn_meta,
                                          self.wo, self.ffn_norm.weight, self.w_gate_up, self.w_down)
        if self.fused:
            attn = self._attention_aot(x, cos, sin, pos, write_idx, index, aux, lora_rows)
            x = self._mm_add(attn, self.wo, x, self.lora_o_a, self.lora_o_b, self.lora_o_segs, lora_rows)
            gate_up = self._norm_mm(self.ffn_norm, x, self.w_gate_up, self.lora_gate_up_a, self.lora_gate_up_b,
                                    self.lora_gate_up_segs, lora_rows)
            return self._swiglu_mm_add(gate_up, self.w_down, x, self.lora_down_a, self.lora_down_b,
                                       self.lora_down_segs, lora_rows)
        b, t, dim = x.shape
        attn = self._mm(self._attention_ops(self.attn_norm(x), cos, sin, write_idx, index, aux, lora_rows), self.wo,
                        self.lora_o_a, self.lora_o_b, self.lora_o_cols, lora_rows)
        x = x + ops.reshape(attn, (b, t, dim))
        gate_up = self._mm(ops.reshape(self.ffn_norm(x), (b * t, dim)), self.w_gate_up, self.lora_gate_up_a,
                           self.lora_gate_up_b, self.lora_gate_up_cols, lora_rows)
        act = ops.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:]
        down = self._mm(act, self.w_down, self.lora_down_a, self.lora_down_b, self.lora_down_cols, lora_rows)
        return x + ops.reshape(down, (b, t, dim))


class LlamaModel(nn.Cell):
    """ids/positions in, logits of one chosen row per sequence and the final-normed hidden states out.

    Inputs: ids, pos [B, T] int32; write_idx [B*T*kv] int32 (cache row ``head * num_slots + slot`` of each
    new K/V head row, token-major; padding -> scratch slot 0); then, with the AOT kernels, index = the
    block table [R, NB] int32 (padded with the scratch block 0) and aux = each token's table row [B*T]
    int32 (so one row of T tokens can pack several prompts); without them, index = read rows [kv, B, W]
    int32 (cache row of each head and key position of a row's window, padded with slot 0) and aux = the
    mask [B, 1, T, W] float32 (0 where key j <= pos, else -1e9); last_rows [R] int32 (flat rows in B*T
    whose logits to return).
    """

    def __init__(self, spec: ModelSpec, w: dict[str, np.ndarray], num_blocks: int, block_size: int,
                 max_positions: int, aot=None, dtype: str = "float32", lora: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.lora = lora is not None  # (slots, rank): adapter slots in every layer, and a lora_rows input
        self.dim, self.head_dim = spec.hidden_size, spec.head_dim
        self.aot = aot
        self.fused = aot is not None
        # The AOT kernels compute in float32; the stock ops in ``dtype`` (logits and hidden out in float32).
        self.dtype = dt = DTYPES[dtype]
        self.low_precision = dt != ms.float32
        self.embed = _param(w["model.embed_tokens.weight"], "embed", dt)
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        self.head = _weight([head], "lm_head", self.fused, dt)  # [D, V]: a separate copy even when tied
        cos, sin = rope_tables(spec.head_dim, max_positions, spec.rope_theta)
        self.cos, self.sin = _param(cos, "rope_cos", dt), _param(sin, "rope_sin", dt)
        self.layers = nn.CellList([DecoderLayer(spec, w, i, num_blocks * block_size, block_size, aot, dt, lora)
                                   for i in range(spec.num_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], spec.rms_norm_eps, "norm", aot, dt)

    def construct(self, ids, pos, write_idx, index, aux, last_rows, lora_rows=None):
        if self.fused:
            return self._forward_aot(ids, pos, write_idx, index, aux, last_rows, lora_rows)
        b, t = ids.shape
        x = ops.gather(self.embed, ids, 0)  # [B, T, D]
        cos = ops.expand_dims(ops.gather(self.cos, pos, 0), 2)  # [B, T, 1, hd]
        sin = ops.expand_dims(ops.gather(self.sin, pos, 0), 2)
        if self.low_precision:
            aux = ops.cast(aux, self.dtype)  # the mask
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, index, aux, lora_rows)
        hidden = self.norm(ops.reshape(x, (b * t, self.dim)))
        logits = ops.matmul(ops.gather(hidden, last_rows, 0), self.head)  # [B, V]
        if self.low_precision:
            return ops.cast(logits, ms.float32), ops.cast(hidden, ms.float32)
        return logits, hidden

    def _forward_aot(self, ids, pos, write_idx, index, aux, last_rows, lora_rows):
        """The AOT path: rows flat [B*T, ...] all the way through (ids/pos keep their [B, T] shape; the kernels
        read them as B*T elements); one op in (embedding and rotary rows), one per layer, one out (final
        norm, logit rows, LM head)."""
        x, cos, sin = self.aot.embed_rope(ids, pos, self.embed, self.cos, self.sin)  # [N, dim], [N, hd], [N, hd]
        for layer in self.layers:
            x = layer(x, cos, sin, pos, write_idx, index, aux, lora_rows)
        return self.aot.norm_head(x, self.norm.weight, self.norm.eps_t, last_rows, self.head)


class LMHead(nn.Cell):
    """Logits for already-normed hidden rows ``[N, D]`` (prompt logprobs); shares the model's head weights."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.head = model.head
        self.aot, self.fused = model.aot, model.fused
        self.dtype, self.low_precision = model.dtype, model.low_precision

    def construct(self, hidden):
        if self.fused:
            return self.aot.matmul(hidden, self.head)
        if self.low_precision:
            return ops.cast(ops.matmul(ops.cast(hidden, self.dtype), self.head), ms.float32)
        return ops.matmul(hidden, self.head)


_threads_set: list[int] = []


def set_mode(mode: int, device_target: str, threads: int | None) -> None:
    """Global MindSpore context: GRAPH_MODE (0) or PYNATIVE_MODE (1); CPU threads (settable once per process)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == 0 else ms.PYNATIVE_MODE)
    if not _threads_set:
        try:
            ms.set_device(device_target)
            if threads:
                ms.device_context.cpu.op_tuning.threads_num(threads)
        except RuntimeError as exc:  # the runtime already started (some op ran first): keep its settings
            logging.getLogger("mindserve.engine").warning("MindSpore device/threads left as they are: %s", exc)
        _threads_set.append(threads or 0)
    if mode == 1:
        ms.runtime.launch_blocking()  # PyNative's async dispatch costs ~1 ms per op on CPU


def set_device(spec: ModelSpec, threads: int | None) -> str:
    """Set MindSpore's context to the yaml's ``context`` (mode, device_target) and return the device it runs
    on. A target whose runtime is absent is a ConfigError naming the yaml key and what was found."""
    target = spec.device_target
    if not _available(target):
        found = [t for t in DEVICE_TARGETS if t != target and _available(t)]
        raise ConfigError(spec.yaml_path, "context.device_target",
                          f"{target}, but this MindSpore {ms.__version__} has no {target} runtime "
                          f"(found: {', '.join(found) or 'none'})")
    set_mode(spec.mode, target, threads)
    actual = ms.get_context("device_target")
    if actual != target:
        raise ConfigError(spec.yaml_path, "context.device_target",
                          f"{target}, but MindSpore already runs on {actual} in this process")
    return actual


def _available(target: str) -> bool:
    from mindspore import hal

    with _quiet_mindspore():  # a missing runtime is our error to report, not a page of plugin warnings
        return bool(hal.is_available(target))


@contextlib.contextmanager
def _quiet_mindspore():
    try:
        from mindspore import log as ms_log

        logger = ms_log._get_logger()  # MindSpore's own logger (not under the "mindspore" name)
    except (ImportError, AttributeError):
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)

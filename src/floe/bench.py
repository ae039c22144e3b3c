"""`floe bench decode`: batch-1 decode speed at real shapes against the bandwidth roofline measured in
the same run, and against peers on the identical weights in the same run: Hugging Face transformers
eager, and transformers with a static cache under torch.compile(mode="reduce-overhead").

Weights are seeded random (no download); the tokenizer is the default model's or a given folder.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from floe.engine import Engine, Generation, SamplingParams, generate
from floe.model.synthetic import random_checkpoint
from floe.model.tokenizer import Tokenizer
from floe.profile import count_dispatches, prefill_flops

CONTEXT = 256  # tokens in the cache while decode is timed


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s a large copy moves (read + write)."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), 10)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, 5)


def decode_bytes(engine: Engine) -> int:
    """Bytes one batch-1 decode step must read: every weight once (one embedding row only), quantized
    layers at their stored size, a quantized embedding table's row as the file stores it."""
    from floe.engine.int4 import Int4Linear
    from floe.engine.qgemv import QLinear
    from floe.engine.transformer import QuantizedEmbedding

    model, c = engine.model, engine.config
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.nbytes for m in model.modules() if isinstance(m, Int4Linear | QLinear))
    if isinstance(model.tok_embeddings, QuantizedEmbedding):  # not a parameter: its row only
        total += model.tok_embeddings.row_nbytes
    elif not c.tie_embeddings or model.head is not None:  # the table is read one row at a time
        total -= (c.vocab_size - 1) * c.dim * model.tok_embeddings.weight.element_size()
    return total


def count_kernels(step, device: torch.device, steps: int = 5) -> float:
    """Device kernels (GPU) or framework ops (CPU) per call of step()."""
    counts = count_dispatches(step, device, steps)
    return counts["device_kernels"] if device.type == "cuda" else counts["framework_ops"]


def floe_row(engine: Engine) -> dict:
    engine.kv_truncate(0)
    engine.prefill(list(range(100, 100 + CONTEXT)))

    def step():
        engine.decode_step(300)
        engine.kv_truncate(CONTEXT)

    s = timed(step, 100)
    return {"ms_per_token": s * 1e3, "tok_s": 1 / s, "kernels_per_token": count_kernels(step, engine.device)}


# transformers' classes for the architectures of the benchmark's shapes (config.KNOWN_SHAPES)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
HF_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
HF_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# Gemma's four norms: its post_attention_layernorm follows attention; pre_feedforward feeds the MLP
HF_GEMMA_LAYER_NAMES = {**HF_LAYER_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "post_ffn_norm.weight": "post_feedforward_layernorm.weight"}


def hf_config(c, dtype: torch.dtype):
    """transformers' config of a floe ModelConfig (Llama, Qwen2, Qwen3 or Gemma 3's text model)."""
    import transformers

    if c.arch not in HF_CLASSES:
        raise ValueError(f"no transformers peer for {c.arch} models here; run with --no-peers")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": c.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    extra = {}
    if c.arch == "gemma3":
        full = rope if c.rope_linear_factor == 1.0 else {
            "rope_type": "linear", "rope_theta": c.rope_theta, "factor": c.rope_linear_factor}
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
                "full_attention": full}
        extra = dict(sliding_window=c.sliding_window, query_pre_attn_scalar=round(c.attention_scale**-2),
                     hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
    return getattr(transformers, HF_CLASSES[c.arch][0])(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.context_length,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        rope_parameters=rope,
        torch_dtype=dtype,
        **extra,
    )


def hf_model(engine: Engine):
    """A transformers model of the engine's architecture sharing its checkpoint's tensors (no copy;
    Gemma's norms, which transformers stores as w for its (1 + w), are w - 1)."""
    import transformers

    c = engine.config
    cfg = hf_config(c, engine.dtype)
    with torch.device("meta"):
        model = getattr(transformers, HF_CLASSES[c.arch][1])(cfg)
    gemma = c.arch == "gemma3"
    layer = HF_GEMMA_LAYER_NAMES if gemma else HF_LAYER_NAMES
    state = {}
    for name, t in engine.checkpoint.weights.items():
        t = t.to(engine.device, engine.dtype)
        if gemma and name.endswith("norm.weight"):
            t = t - 1
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            state[f"model.layers.{i}.{layer[rest]}"] = t
        else:
            state[HF_NAMES[name]] = t
    if c.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=False)
    with torch.device(engine.device):  # the buffers made on meta above: inv_freq, Gemma's embed_scale
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
        if gemma:
            model.model.embed_tokens.embed_scale = torch.tensor(c.embedding_scale)
    return model.eval()


@torch.inference_mode()
def hf_eager_row(model, device: torch.device) -> dict:
    from transformers import DynamicCache

    ids = torch.arange(100, 100 + CONTEXT, device=device)[None]
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = torch.tensor([[300]], device=device)

    def step():
        model(input_ids=token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the step just taken

    s = timed(step, 30)
    return {"ms_per_token": s * 1e3, "tok_s": 1 / s, "kernels_per_token": count_kernels(step, device)}


@torch.inference_mode()
def hf_compiled_row(model, device: torch.device) -> dict:
    """transformers' own recipe: a static cache and the forward under torch.compile(mode=
    "reduce-overhead"), driven by generate(); decode time = (128 new tokens - 1 new token) / 127."""
    from transformers import StaticCache

    ids = torch.arange(100, 100 + CONTEXT, device=device)[None]
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(new: int) -> None:
        cache = StaticCache(config=model.config, max_cache_len=CONTEXT + 160)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )

    t0 = time.perf_counter()
    for _ in range(2):
        run(128)
        run(1)
    compile_s = time.perf_counter() - t0
    long, short = timed(lambda: run(128), 3, warmup=0), timed(lambda: run(1), 3, warmup=0)
    s = (long - short) / 127
    return {
        "ms_per_token": s * 1e3,
        "tok_s": 1 / s,
        "compile_and_warmup_s": compile_s,
        "kernels_per_token": float("nan"),
    }


@torch.inference_mode()
def agreement(engine: Engine, model) -> dict:
    """First decode step's logits of floe vs the transformers peer on the same weights."""
    ids = list(range(100, 100 + 64))
    engine.kv_truncate(0)
    engine.prefill(ids)
    ours = engine.decode_step(300).float().cpu().clone()
    engine.kv_truncate(0)
    ref = model(input_ids=torch.tensor([ids + [300]], device=engine.device)).logits[0, -1].float().cpu()
    return {
        "rel_error": float((ours - ref).norm() / ref.norm()),
        "max_abs": float((ours - ref).abs().max()),
        "same_argmax": int(ours.argmax()) == int(ref.argmax()),
    }


def guest_share(engine: Engine, tokens: int = 128) -> dict:
    """Guest-driven (chat.wasm) vs host-driven decode tok/s, interleaved."""
    from floe.actor import Actor

    prompt = "Write a long story about a lighthouse keeper."
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    host, guest = [], []
    for _ in range(4):
        slot = engine.claim_slot()
        r = Generation()
        list(generate(engine, ids, SamplingParams(), tokens, slot=slot, result=r))
        engine.release_slot(slot)
        host.append(r.decode_tokens_per_s)
        with Actor(engine) as a:
            guest.append(a.send(prompt, max_tokens=tokens).stats.decode_tokens_per_s)
    h, g = statistics.median(host[1:]), statistics.median(guest[1:])
    return {"host_tok_s": h, "guest_tok_s": g, "guest_cost_pct": 100 * (h - g) / h}


@torch.inference_mode()
def prefill_vs_floor(engine: Engine, rate: float, n: int = 2048) -> dict:
    c = engine.config
    n = min(n, engine.max_seq_len)
    ids = list(range(100, 100 + n))

    def run():
        engine.kv_truncate(0)
        engine.prefill(ids)

    t = timed(run, 3)
    flops = prefill_flops(c, n)
    engine.kv_truncate(0)
    return {
        "tokens": n,
        "ms": t * 1e3,
        "floor_ms": flops / rate * 1e3,
        "pct_of_floor": 100 * flops / rate / t,
    }


def decode(
    shape: str, device: str, tokenizer: Tokenizer, peers: bool = True, guest: bool = True, progress=print
) -> dict:
    """Everything `floe bench decode` reports, for one shape on one device."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bandwidth, rate = copy_bandwidth(dev), matmul_rate(dev, dtype)
    progress(f"{dev}: copy {bandwidth / 1e9:.0f} GB/s, matmul {rate / 1e12:.1f} TFLOP/s")
    ckpt = random_checkpoint(shape, tokenizer, dtype=dtype, device=dev)
    engine = Engine(ckpt, device=dev, dtype=dtype, max_seq_len=2304, n_slots=2)
    nbytes = decode_bytes(engine)
    ceiling = bandwidth / nbytes
    result = {
        "shape": shape,
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "bandwidth_gb_s": bandwidth / 1e9,
        "matmul_tflop_s": rate / 1e12,
        "decode_bytes_per_token": nbytes,
        "ceiling_tok_s": ceiling,
        "engines": {},
    }

    def add(name, row):
        row["pct_roofline"] = 100 * row["tok_s"] / ceiling
        result["engines"][name] = row
        progress(
            f"  {name:<36} {row['tok_s']:8.1f} tok/s  {row['ms_per_token']:7.3f} ms  "
            f"{row['pct_roofline']:5.1f} %  {row['kernels_per_token']:6.0f} kernels"
        )

    add("floe", floe_row(engine))
    if dev.type == "cuda":
        eager = Engine(ckpt, device=dev, dtype=dtype, max_seq_len=2304, cuda_graphs=False)
        add("floe eager (no graph)", floe_row(eager))
        del eager
    else:  # the lean step's own peer: the module forward on the same weights
        plain = Engine(ckpt, device=dev, dtype=dtype, max_seq_len=2304, fused_kernels=False)
        add("floe module forward (no lean step)", floe_row(plain))
        del plain
    if peers:
        model = hf_model(engine)
        result["agreement_with_transformers"] = agreement(engine, model)
        progress(f"  logits vs transformers: {json.dumps(result['agreement_with_transformers'])}")
        run_peer(result, "transformers eager", hf_eager_row, model, dev, add, progress)
    if guest:
        result["guest_vs_host"] = guest_share(engine)
        progress(f"  guest-driven vs host-driven: {json.dumps(result['guest_vs_host'])}")
    result["prefill"] = prefill_vs_floor(engine, rate)
    progress(f"  prefill: {json.dumps(result['prefill'])}")
    if peers and dev.type == "cuda":  # reduce-overhead means CUDA graphs: GPU-only peers; last,
        # because a peer that fails inside CUDA can leave the context unusable.
        from floe.peer import plain_compiled_row

        run_peer(result, "pytorch static + torch.compile", lambda _m, _d: plain_compiled_row(engine, CONTEXT),
                 None, dev, add, progress)
        run_peer(result, "transformers static + torch.compile", hf_compiled_row, model, dev, add, progress)
    return result


def run_peer(result: dict, name: str, fn, model, device, add, progress) -> None:
    try:
        add(name, fn(model, device))
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        result["engines"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        progress(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}")


def dispatch(device: str, n: int = 2000, sizes: tuple[int, ...] = (1, 4096)) -> dict:
    """The cost of one kernel launch, three ways (after arXiv 2604.02344's method), on tiny kernels:
    (a) dispatch then synchronize each time, (b) n dispatches then one sync, (c) n dispatches replayed
    from one CUDA graph. Microseconds per kernel; (a) overstates launch cost by including the sync."""
    dev = torch.device(device)
    rows = {f"add_ {size} float32": _dispatch_row(dev, size, n) for size in sizes}
    return {"device": str(dev), "n": n, "kernels": rows}


def _dispatch_row(dev: torch.device, size: int, n: int) -> dict:
    x = torch.zeros(size, device=dev)
    runs = 0

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def each_synced() -> None:
        for _ in range(n):
            x.add_(1.0)
            sync()

    def batched() -> None:
        for _ in range(n):
            x.add_(1.0)
        sync()

    row = {
        "a_dispatch_sync_us": wall_time(each_synced) / n * 1e6,
        "b_dispatch_batch_us": wall_time(batched) / n * 1e6,
        "c_graph_replay_us": None,
    }  # no graphs on the CPU: every op is dispatched by the framework
    runs += 16
    if dev.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1.0)

        def replay() -> None:
            graph.replay()
            sync()

        row["c_graph_replay_us"] = wall_time(replay) / n * 1e6
        row["ratio_b_over_c"] = row["b_dispatch_batch_us"] / row["c_graph_replay_us"]
        runs += 8
    row["ratio_a_over_b"] = row["a_dispatch_sync_us"] / row["b_dispatch_batch_us"]
    # Every kernel really ran: each of the `runs` calls added n ones to every element.
    row["checked"] = bool(torch.all(x == float(runs * n)).item())
    return row


def together(fns: list) -> tuple[list, float]:
    """Each fn() in its own thread, all released at once (e.g. actors sending at the same moment):
    their results, and the wall seconds from the release until the last one ended."""
    import threading

    results: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns) + 1)

    def work(i: int) -> None:
        barrier.wait()
        results[i] = fns[i]()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def wall_time(fn, repeats: int = 5, warmup: int = 3) -> float:
    """Median wall seconds of fn() (each fn ends with its own synchronisation)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)

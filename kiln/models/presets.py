"""Named model shapes, kept as data: a preset fills every model field the config leaves unset."""

LLAMA3_ROPE = {"type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_seq_len": 8192}

PRESETS: dict[str, dict] = {
    # ~10M parameters: the CPU quickstart.
    "quickstart": dict(vocab_size=8192, dim=384, n_layers=4, n_heads=6, n_kv_heads=2,
                       intermediate_size=1024, max_seq_len=1024, rope_theta=10000.0,
                       tie_embeddings=True),
    # The benchmark workload of bench/throughput.py.
    "bench-7m": dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                     intermediate_size=704, max_seq_len=256, tie_embeddings=False),
    "llama-2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       intermediate_size=11008, max_seq_len=4096, rope_theta=10000.0,
                       norm_eps=1e-5),
    "llama-3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         intermediate_size=8192, max_seq_len=131072, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, norm_eps=1e-5,
                         tie_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         intermediate_size=14336, max_seq_len=131072, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, norm_eps=1e-5),
    "mistral-7b": dict(vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       intermediate_size=14336, max_seq_len=32768, rope_theta=1000000.0,
                       norm_eps=1e-5),
    "qwen2.5-0.5b": dict(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         intermediate_size=4864, max_seq_len=32768, rope_theta=1000000.0,
                         norm_eps=1e-6, qkv_bias=True, tie_embeddings=True),
    "qwen3-0.6b": dict(vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, intermediate_size=3072, max_seq_len=40960,
                       rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, tie_embeddings=True),
    # Mixtures of experts: 46.7B parameters, 12.9B active per token.
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         intermediate_size=14336, max_seq_len=32768, rope_theta=1000000.0,
                         norm_eps=1e-5, moe=dict(n_experts=8, top_k=2, norm_topk_prob=True,
                                                 aux_loss_coef=0.02)),
    # 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, intermediate_size=6144, max_seq_len=40960,
                          rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                          moe=dict(n_experts=128, top_k=8, intermediate_size=768,
                                   norm_topk_prob=True, aux_loss_coef=0.001)),
}

"""Named architectures for `load_format: dummy` (random weights; GPU benchmarks use these)."""

from __future__ import annotations

from typing import Any

_LLAMA_3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA_3_ROPE}, "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA_3_ROPE, "factor": 8.0}, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    # A few MB: the MoE path (routing, expert parallelism) on CPU.
    "mixtral-tiny": {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    # Multi-head latent attention (a latent KV cache) and 64 routed + 2 shared experts.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "topk_method": "greedy",
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        },
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "bos_token_id": 100000, "eos_token_id": 100001,
    },
}

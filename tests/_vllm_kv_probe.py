"""Start vLLM (CPU) on a checkpoint and print the KV blocks it allocated: `python _vllm_kv_probe.py
CHECKPOINT DTYPE MAX_MODEL_LEN MAX_NUM_SEQS [KV_CACHE_MEMORY_BYTES]`, with VLLM_CPU_KVCACHE_SPACE set or
the last argument given. vLLM spawns its engine
process, so this runs as a script (a `__main__` guard), not inside pytest."""

import json
import sys


def main() -> None:
    from vllm import LLM

    checkpoint, dtype, max_model_len, max_num_seqs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    kv_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else None
    llm = LLM(model=checkpoint, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              enforce_eager=True, kv_cache_memory_bytes=kv_bytes)
    cache = llm.llm_engine.vllm_config.cache_config
    print("KV " + json.dumps({"blocks": cache.num_gpu_blocks, "block_size": cache.block_size}), flush=True)


if __name__ == "__main__":
    main()

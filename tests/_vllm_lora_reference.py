"""vLLM's own offline answers for the LoRA test: `python _vllm_lora_reference.py CHECKPOINT REQUESTS.json
[LMI_ARGV.json]`, REQUESTS a list of {"prompt", "max_tokens", "adapter": null | {"name", "path"}}; prints
`ANSWERS [text, ...]`. With LMI_ARGV (the command line LMI builds from serving.properties), first
`ENGINE_ARGS [...]`: what vLLM's EngineArgs parser makes of it (one vLLM import for both).
Greedy, `LLM(enable_lora=True)` with a `LoRARequest` per adapter, no speculative decoding (the server under
test runs with it). vLLM spawns its engine process, so this runs as a script, not inside pytest."""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    checkpoint, requests = sys.argv[1], json.loads(open(sys.argv[2]).read())
    if len(sys.argv) > 3:
        from vllm import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(json.loads(open(sys.argv[3]).read()))
        engine = EngineArgs.from_cli_args(parsed)
        print("ENGINE_ARGS " + json.dumps([engine.enable_lora, engine.max_loras, engine.max_lora_rank,
                                           engine.max_cpu_loras, engine.speculative_config]), flush=True)
    llm = LLM(model=checkpoint, dtype="float32", max_model_len=96, max_num_seqs=4, enforce_eager=True, seed=0,
              enable_lora=True, max_lora_rank=8, max_loras=2, kv_cache_memory_bytes=1 << 30)
    ids = {}
    answers = []
    for request in requests:
        adapter = request["adapter"]
        lora = None
        if adapter is not None:
            ids.setdefault(adapter["name"], len(ids) + 1)
            lora = LoRARequest(adapter["name"], ids[adapter["name"]], adapter["path"])
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
        output = llm.generate([request["prompt"]], params, lora_request=lora, use_tqdm=False)[0]
        answers.append(output.outputs[0].text)
    print("ANSWERS " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    main()

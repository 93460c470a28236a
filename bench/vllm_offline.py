"""vLLM's side of `ferry bench offline --systems vllm`: run in vLLM's own interpreter (`--vllm-python`), never
imported by Ferry.

Reads a job (JSON: model directory, token-id prompts, output lengths, slots, token budget, dtype, warm-up prompts,
repeats) from argv[1], runs vLLM's offline `LLM.generate` over it greedily with EOS ignored, and writes each
repeat's wall time and the generated token ids to argv[2]. Standard library and vLLM only.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(job_path) as f:
        job = json.load(f)
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        load_format=job["load_format"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
        # Prompts are token ids and outputs are compared as ids: the model directory needs no tokenizer.
        skip_tokenizer_init=True,
    )
    startup = time.perf_counter() - started

    def run(prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in output_lens]
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, [list(out.outputs[0].token_ids) for out in outputs]

    if job["warmup_prompts"]:
        run(job["warmup_prompts"], job["warmup_output_lens"])
    repeats = [run(job["prompts"], job["output_lens"]) for _ in range(job["repeat"])]
    with open(out_path, "w") as f:
        json.dump(
            {
                "startup_seconds": startup,
                "wall_seconds": [wall for wall, _ in repeats],
                "tokens": [tokens for _, tokens in repeats],
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

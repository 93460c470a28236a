"""vLLM's side of `ferry bench images --systems vllm`: run in vLLM's own interpreter (`--vllm-python`), never
imported by Ferry.

Reads a job (JSON: model directory, token-id prompts with one image placeholder each, image files, output length,
slots, token budget, dtype) from argv[1], runs vLLM's offline `LLM.generate` over it greedily with EOS ignored after
one warm-up request, and writes the wall time and the generated token ids to argv[2]. Standard library, PIL and
vLLM only.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    from PIL import Image
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        seed=0,
        limit_mm_per_prompt={"image": 1},
    )
    images = [Image.open(path).convert("RGB") for path in job["images"]]
    params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
    inputs = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        for ids, image in zip(job["prompts"], images, strict=True)
    ]
    llm.generate(inputs[:1], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"wall_seconds": wall, "tokens": [list(out.outputs[0].token_ids) for out in outputs]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Engine counters, sent to the front end every step: kept free of torch so unpickling them stays cheap."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_pages: int
    """KV-cache pages of the primary pool (`--num-pages` sets it)."""
    num_free_pages: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    last_step_tokens: int
    cpu_threads: int = 0
    """Torch threads the last step ran on, on CPU (engine/execution/cpu_threads.py: by the step's size and, by
    default, the load beside the engine); 0 on a GPU."""
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters the running requests use (vLLM's `vllm:lora_requests_info` labels)."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters waiting requests ask for."""
    images_processed: int = 0
    """Images the requests taken held (an image model's)."""
    encoder_cache_hits: int = 0
    """Images a prefill reached whose encoding was held already (the same image in another request; an image
    whose pages the prefix cache held is not looked up at all)."""
    encoder_cache_usage: float = 0.0
    """Fraction of --encoder-cache-tokens holding image encodings."""
    spec_decode_num_drafts: int = 0
    """Draft runs verified (a request's drafts in one step), with --speculative-config."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = field(default=())
    """Accepted drafts by their position in the run (0: the first draft)."""

#!/usr/bin/env python
"""Peak host memory of loading a model with Ferry's loader, against the size of the loaded weights.

Prints one JSON object: `weights_bytes` (the checkpoint's tensors in the target dtype), `loaded_bytes` (the weights as
the loaded model stores them: quantized codes and scales under --quantization), `peak_anon_bytes` (the largest
growth of the process's anonymous memory while loading, sampled from /proc/self/status every millisecond),
`peak_rss_bytes` (the growth of the peak resident set, ru_maxrss, which also counts the checkpoint's pages read
through mmap: page cache, given back as soon as the files are closed) and `loader` (the file of the loader it ran).
tracemalloc would see none of it: torch allocates its storage outside Python's allocator.

Run from a checkout, put that checkout on PYTHONPATH: the script's own folder heads sys.path, so an installed copy of
Ferry elsewhere would otherwise be the one measured.

Usage:  python scripts/load_peak_memory.py MODEL_DIR [--dtype bfloat16] [--quantization int8]
        (Linux only: /proc and ru_maxrss)
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import threading
import time


def _anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


class _PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _anon_bytes()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _anon_bytes())
            time.sleep(0.001)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _anon_bytes())


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _checkpoint_bytes(model_dir: str, element_bytes: int) -> int:
    from safetensors import safe_open

    from engine.models.checkpoint import checkpoint_files

    total = 0
    for path, names in checkpoint_files(model_dir).items():
        with safe_open(path, framework="pt") as f:
            for name in f.keys() if names is None else names:
                total += math.prod(f.get_slice(name).get_shape()) * element_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int8-dynamic", "int4", "fp8"])
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.models import loader

    config = EngineConfig.of(
        model=args.model_dir, dtype=args.dtype, device="cpu", model_impl="native", quantization=args.quantization
    )
    # Reading the config first imports its transformers modules (tens of MB of code and tables), which the engine
    # now imports on its first config rather than with the loader: they are not the load's memory.
    loader.model_config(config)
    anon_before, rss_before = _anon_bytes(), _max_rss_bytes()
    sampler = _PeakSampler()
    sampler.start()
    loaded = loader.load_model(config)
    peak_anon = sampler.stop()
    weights = _checkpoint_bytes(args.model_dir, _DTYPE_BYTES[args.dtype])
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "quantization": args.quantization,
                "weights_bytes": weights,
                "loaded_bytes": loader.weight_bytes(loaded.model),
                "peak_anon_bytes": peak_anon - anon_before,
                "peak_rss_bytes": _max_rss_bytes() - rss_before,
                "loader": loader.__file__,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Model implementations the runner can drive: native Llama-family modules, and an adapter for the rest."""

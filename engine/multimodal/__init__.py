"""Images in prompts: the processed image a request carries (inputs.py), the scheduler's account of which images'
encodings the runner holds (encoder_cache.py), and each vision family's split of its processor's output into
per-image inputs (families.py)."""

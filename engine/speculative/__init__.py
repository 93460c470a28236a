"""Speculative decoding: where drafts come from (ngram, suffix, a client's prediction) and how many to send."""

"""packshard pipeline: the Ray pack job, input readers, tokenization, stats and verify CLIs."""

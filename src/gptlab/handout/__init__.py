"""Handout #11 as checks: its properties (`properties`), its worked numbers (`worked`), `gptlab lab`
(`lab`), the same checks on trained runs (`verify`, `verify_seq2seq`, `verify_finetune`), and a learner's
own code graded against them (`learner/`: `gptlab check` and `gptlab break`)."""

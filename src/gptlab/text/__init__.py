"""Text <-> token ids: the tokenizers saved in every checkpoint (`tokenizer`), BPE training in a child
process (`bpe`), and chat templates that turn a conversation into one text (`chat_template`)."""

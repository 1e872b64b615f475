"""Training text: built-in corpora and user files (`corpora`), preparation into token files
(`prepare`), and the prepared folder's random batches (`tokens`)."""

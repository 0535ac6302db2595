"""Pure text logic: chat templates, detokenization, stop strings, markup."""

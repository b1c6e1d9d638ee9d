"""The conversation layer (no torch): OpenAI-style messages and their images (:mod:`.messages`),
image files (:mod:`.images`), tokenizer, chat template and image processor (:mod:`.processor`),
streamed detokenization (:mod:`.detokenizer`) and the reasoning split (:mod:`.reasoning`)."""

"""The conversation layer (no torch): OpenAI-style messages and their images (:mod:`.messages`),
image files (:mod:`.images`), tokenizer, chat template and image processor (:mod:`.processor`),
streamed detokenization (:mod:`.detokenizer`), the reasoning split (:mod:`.reasoning`), what a
reply may be (tools, tool choice, response schema: :mod:`.tools`), tool calls in a reply's text
(:mod:`.tool_calls`) and the grammars that enforce a reply's form (:mod:`.grammar`)."""

"""What a request and its reply look like: chat templates, tools, grammars (constrained output), the
`Request` every door builds and the `Reply` every door reads."""

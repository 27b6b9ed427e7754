"""pyagent-tiktoken: a tiktoken tokenizer for pyagent-framework (see ``pyagent_tiktoken.tokenizer``)."""

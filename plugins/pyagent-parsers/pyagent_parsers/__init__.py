"""pyagent-parsers: tool-call and reasoning parsers for the formats model families emit."""

"""The engine's errors; they live in :mod:`pyagent_framework.errors`."""

from pyagent_framework.errors import ConfigError, InvalidRequestError  # noqa: F401

#: A request of the wrong kind for the model, refused (param ``model``) by the front end
#: and, for a client that reaches the core some other way, by the core too.
TEXT_MODEL_NO_EMBEDDINGS = ("this model generates text; embeddings need an embedding model (an encoder such as "
                            "BERT or all-MiniLM-L6-v2)")
EMBEDDING_MODEL_NO_TEXT = ("this model is an embedding model (an encoder): it makes embeddings (LLM.embed, "
                           "/v1/embeddings) and generates no text")
CROSS_ENCODER_NO_TEXT = ("this model is a cross-encoder (a sequence classifier): it scores text pairs (LLM.score, "
                         "/v1/score, /rerank) and generates no text")
CROSS_ENCODER_NO_EMBEDDINGS = ("this model is a cross-encoder (a sequence classifier): it scores text pairs (LLM.score, "
                               "/v1/score, /rerank) and makes no embeddings")
TEXT_MODEL_NO_SCORES = ("this model generates text; scores need a cross-encoder (BertForSequenceClassification and "
                        "the like) or an embedding model")

from __future__ import annotations

from abc import ABC, abstractmethod


class ChatTemplateSource(ABC):
    """A named chat template: Jinja source the kernel renders in a sandbox.

    :class:`pyagent_framework.chat_templates.ChatTemplate` is the usual entry.
    """

    @property
    @abstractmethod
    def source(self) -> str: ...

"""The OpenAI front end's import surface: `from tokenloop.serving.api import create_app` keeps working.

The front end lives one room per stage: `base.py` (submission bookkeeping and `ServingBase`: submit,
collect, model checks, /tokenize, /detokenize, /v1/models, the off-loop executor), `completions.py`
(/v1/completions), `chat.py` (/v1/chat/completions) and `app.py` (`create_app`, the routes, the
exception handlers, and `OpenAIServing`, the endpoints on one base). Nothing is defined here.
"""

from __future__ import annotations

from tokenloop.serving.app import OpenAIServing, create_app
from tokenloop.serving.base import ServingBase
from tokenloop.serving.chat import ChatServing
from tokenloop.serving.completions import CompletionsServing

__all__ = ["ChatServing", "CompletionsServing", "OpenAIServing", "ServingBase", "create_app"]

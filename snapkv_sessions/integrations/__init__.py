"""Agent-framework integrations.

``snapkv_sessions.integrations.openai``: OpenAI-style tools and tool calls (no extra dependency).
``snapkv_sessions.integrations.langchain``: :class:`ChatSnapKV`, a LangChain chat model backed by a Session
(``pip install 'snapkv-sessions[langchain]'``). Neither is imported by ``import snapkv_sessions``.
"""

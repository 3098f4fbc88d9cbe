"""Durable sessions in the daemon: resumable generations (``_resumable``) and server-side conversations
(``_conversations``), both kept in the session log. Their HTTP routes live in ``superfluid.api``."""

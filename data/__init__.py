"""Conversation sources, chat templating and loss masks, offline assets, the feature store and the
precompute stage."""

"""Gradient communication: process groups by NVLink island, DDP comm hooks, and what they cost."""

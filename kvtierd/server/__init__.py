"""The daemon: an aiohttp app on a Unix socket, its settings and its routes."""

"""The HTTP surface: the app, the fast lane, request bodies, errors, /score and /route
handlers."""

"""The Runpod serverless worker around the engine: job schemas and limits, the job runner (`service.Worker`),
OpenAI-shaped routes and the SDK start-up (`serverless`, imported first by handler.py, so this package imports
nothing heavy itself)."""

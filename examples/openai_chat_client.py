"""Chat with a running server through the `openai` client: vLLM's OpenAI client example.

    jaxpaged serve [MODEL]                  # in one terminal
    python examples/openai_chat_client.py   # in another

The server's address comes from OPENAI_BASE_URL (default http://localhost:8000/v1), its key
from OPENAI_API_KEY (any text unless the server was started with --api-key).
"""

import os

from openai import OpenAI

openai_api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")
openai_api_base = os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1")

client = OpenAI(
    api_key=openai_api_key,
    base_url=openai_api_base,
)

models = client.models.list()
model = models.data[0].id

chat_response = client.chat.completions.create(
    model=model,
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke."},
    ],
    temperature=0.7,
    max_tokens=200,
)
print("Chat response:", chat_response.choices[0].message.content)
print("Finish reason:", chat_response.choices[0].finish_reason)
print("Usage:", chat_response.usage)

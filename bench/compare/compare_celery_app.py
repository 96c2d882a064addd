"""The Celery side of bench/compare: a no-op task in Celery's reliable configuration.

Configuration comes from the environment set by celery_bench.py, so the worker process and the
producer import the same app.
"""

import os

from celery import Celery
from kombu import Exchange, Queue

QUEUE = os.environ["COMPARE_QUEUE"]
QUEUE_TYPE = os.environ.get("COMPARE_QUEUE_TYPE", "quorum")

app = Celery(
    "agentq_compare",
    broker=os.environ["COMPARE_BROKER_URL"],
    backend=os.environ["COMPARE_RESULT_URL"],
)
app.conf.update(
    # Ack after the task body returned and its result was stored, not on delivery.
    task_acks_late=True,
    # A worker child killed mid-task gives the message back instead of acking it as failed.
    task_reject_on_worker_lost=True,
    # One unacked message per worker child: the setting Celery's docs give for long tasks.
    worker_prefetch_multiplier=1,
    # Every apply_async waits for the broker's publisher confirm.
    broker_transport_options={"confirm_publish": True},
    task_default_delivery_mode="persistent",
    task_default_queue=QUEUE,
    task_queues=[
        Queue(
            QUEUE,
            Exchange(QUEUE, type="direct", durable=True),
            routing_key=QUEUE,
            durable=True,
            queue_arguments={"x-queue-type": "quorum"} if QUEUE_TYPE == "quorum" else {},
        )
    ],
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # One pooled broker connection per producer thread, so threads never wait for one.
    broker_pool_limit=int(os.environ.get("COMPARE_PRODUCERS", "32")),
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
)


@app.task(acks_late=True)
def noop(i, sent_at):
    """Does nothing: the benchmark measures the job system, not the job."""
    return None

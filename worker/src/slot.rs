//! An operation's lane slot: what bounds how many operations a worker runs at once on a lane
//! (`--concurrency`). A slot counts work, not waiting: while a model call is in flight its
//! operation lends the slot back, so the worker can start another, and takes one again before
//! it goes on. The model gate (`crate::gate`) bounds the calls in flight instead, so a worker
//! holds about its slots plus twice the gate's calls at most: those in calls, and those back
//! from one waiting for a slot (a freed slot goes to the longest waiting, and the consumer
//! waits for one slot at a time).
//!
//! Why it cannot deadlock: an operation lends its slot only once the gate has admitted its call
//! (an operation waiting at the gate keeps its slot, so the waiting are bounded by the slots),
//! and one back from a call has given back all the call held before it waits for a lane slot:
//! its call slot, its budget holds (charged) and its rate reservations (settled), so it holds
//! nothing another operation waits on. So whoever waits for a call slot, or for room its
//! budget's holds take (`context::budget`), holds a lane slot and waits on calls in flight,
//! which end holding neither. (Charged after the slot was taken again, a budget's holds stayed
//! while the operations waiting for its room held every slot: each gave up after its wait and
//! was parked as overloaded.) And no slot sits idle: the lane's consumer takes one only for a
//! delivery in hand (`claim::consume_lane`), never to wait for one.

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One running operation's lane slot: held while it works, lent back during a model call.
#[derive(Debug)]
pub(crate) struct LaneSlot {
    slots: Arc<Semaphore>,
    held: Mutex<Option<OwnedSemaphorePermit>>,
}

impl LaneSlot {
    /// The slot `permit` of the lane's `slots`, held.
    pub(crate) fn new(slots: Arc<Semaphore>, permit: OwnedSemaphorePermit) -> Arc<Self> {
        Arc::new(Self {
            slots,
            held: Mutex::new(Some(permit)),
        })
    }

    /// Gives the slot back for another operation (nothing if it is not held).
    pub(crate) fn release(&self) {
        drop(self.held.lock().expect("slot lock").take());
    }

    /// Takes a slot again if it was lent, waiting for one.
    pub(crate) async fn reacquire(&self) {
        if self.held.lock().expect("slot lock").is_some() {
            return;
        }
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("slots semaphore is never closed");
        *self.held.lock().expect("slot lock") = Some(permit);
    }

    /// Whether the slot is held now.
    #[cfg(test)]
    fn held(&self) -> bool {
        self.held.lock().expect("slot lock").is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_released_slot_serves_another_and_is_reacquired_when_free() {
        let slots = Arc::new(Semaphore::new(1));
        let slot = LaneSlot::new(slots.clone(), slots.clone().try_acquire_owned().unwrap());
        assert_eq!(slots.available_permits(), 0);
        slot.release();
        assert!(!slot.held());
        let other = slots.clone().try_acquire_owned().expect("lent to another");
        let back = tokio::spawn({
            let slot = slot.clone();
            async move { slot.reacquire().await }
        });
        tokio::task::yield_now().await;
        assert!(!back.is_finished(), "waits while the other holds it");
        drop(other);
        back.await.unwrap();
        assert!(slot.held());
        slot.reacquire().await; // held: returns at once, takes no second permit
        assert_eq!(slots.available_permits(), 0);
        drop(slot);
        assert_eq!(slots.available_permits(), 1, "dropped with the operation");
    }
}

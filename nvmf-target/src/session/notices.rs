//! Asynchronous event notices (namespace attribute, ANA and reservation changes) carried by held Asynchronous
//! Event Requests.

use nvpoll::spec::Status;

use crate::admin;

use super::slots::SlotState;
use super::Session;

/// The asynchronous notices a held AER may carry.
#[derive(Clone, Copy, Debug)]
enum Notice {
    /// Namespace Attribute Changed (read the Changed Namespace List).
    NamespaceAttribute,
    /// Asymmetric Namespace Access Change (read the ANA log).
    AnaChange,
    /// Reservation Log Page Available (read the Reservation Notification log).
    Reservation,
}

impl Session {
    /// Takes the namespaces and ANA states as they are now, and on the admin queue hands the notices that
    /// wait to held AERs.
    pub(super) fn poll_notices(&mut self) {
        if let Some(q) = self.state.queue_mut() {
            q.refresh_namespaces();
            if q.qid == 0 && q.ctrl.ns_notice_pending() {
                self.deliver_notice(Notice::NamespaceAttribute);
            }
            if self
                .state
                .queue()
                .is_some_and(|q| q.qid == 0 && q.ctrl.ana_notice_pending())
            {
                self.deliver_notice(Notice::AnaChange);
            }
            if self
                .state
                .queue()
                .is_some_and(|q| q.qid == 0 && q.ctrl.resv_notice_pending())
            {
                self.deliver_notice(Notice::Reservation);
            }
        }
    }

    /// A notice waits: a held AER carries it, if the host enabled such notices (otherwise it is dropped; the
    /// log page it points to still has the news).
    fn deliver_notice(&mut self, notice: Notice) {
        let Some(q) = self.state.queue() else { return };
        let (aec, event) = match notice {
            Notice::NamespaceAttribute => {
                (admin::AEC_NS_ATTRIBUTE, admin::NS_ATTRIBUTE_CHANGED_EVENT)
            }
            Notice::AnaChange => (admin::AEC_ANA_CHANGE, admin::ANA_CHANGE_EVENT),
            // Not in Asynchronous Event Configuration: the Reservation Notification Mask filters these.
            Notice::Reservation => (0, admin::RESERVATION_LOG_EVENT),
        };
        let take = |q: &crate::handler::Queue| match notice {
            Notice::NamespaceAttribute => q.ctrl.take_ns_notice(),
            Notice::AnaChange => q.ctrl.take_ana_notice(),
            Notice::Reservation => q.ctrl.take_resv_notice(),
        };
        let enabled = aec == 0
            || q.admin
                .as_ref()
                .is_some_and(|a| a.async_event_config() & aec != 0);
        if enabled {
            let Some(i) = self
                .slots
                .iter()
                .position(|s| matches!(s.state, SlotState::Held))
            else {
                // The notice waits for the next AER.
                return;
            };
            if take(q) {
                let cid = self.slots[i].cid;
                self.slots[i].state = SlotState::Free;
                self.busy_slots -= 1;
                let _ = self.complete(cid, Status::SUCCESS, event, 0);
            }
        } else {
            take(q);
        }
    }
}

//! What an embedder may move or share between threads, checked at compile time (docs/embedding.md says why).

use nvpoll::aio::{AsyncQueue, LocalExecutor};
use nvpoll::api::{Completion, IoRequest};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::reactor::ReactorWaker;
use nvpoll_tcp::host::{TcpController, TcpQueuePair};
use nvpoll_tcp::multipath::MultipathQueuePair;

fn send<T: Send>() {}
fn sync<T: Sync>() {}

#[test]
fn what_moves_and_what_is_shared() {
    // A pool is shared by every thread that allocates; a buffer moves with its request and completion.
    send::<DmaPool>();
    sync::<DmaPool>();
    send::<DmaBuf>();
    send::<IoRequest>();
    send::<Completion>();
    // A controller and its queue pairs move to the thread (reactor) that drives them, each to one.
    send::<TcpController>();
    send::<TcpQueuePair>();
    send::<MultipathQueuePair>();
    // A reactor's waker may be called from anywhere.
    send::<ReactorWaker>();
    sync::<ReactorWaker>();
}

/// Compiles only for a type that is not `Send`: for a `Send` type both impls apply and the call is ambiguous
/// (the technique of static_assertions' `assert_not_impl_any`).
trait AmbiguousIfSend<A> {
    fn not_send() {}
}
impl<T: ?Sized> AmbiguousIfSend<()> for T {}
impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}

/// The async layer stays on its thread: its handles share one queue pair through `Rc`, and its tasks need not
/// be `Send`, so neither an `AsyncQueue` nor a `LocalExecutor` moves (a compile-time check).
#[test]
fn the_async_layer_is_not_send() {
    <AsyncQueue<TcpQueuePair> as AmbiguousIfSend<_>>::not_send();
    <LocalExecutor as AmbiguousIfSend<_>>::not_send();
}

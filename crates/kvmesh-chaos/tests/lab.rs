//! The lab on this machine (needs root, iproute2, nftables and python3, as the chaos suite
//! does): a partition rule really drops a router's packets, loss leaves some through, heal
//! restores them, and the namespaces and links are gone after the lab is dropped — also when
//! the scope holding it panics.

use kvmesh_chaos::lab::{Lab, resources_of};
use std::process::Command;

fn lab(routers: usize, tag: &str) -> Lab {
    let dir = std::env::temp_dir().join(format!("kvmesh-chaos-lab-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Lab::new(routers, dir, "/bin/false".into()).expect("the lab needs root, iproute2, nftables")
}

/// How many of `n` UDP datagrams router 0 gets through to router 1.
fn delivered(lab: &Lab, n: u32) -> u32 {
    let (to, ns0, ns1) = (lab.router_ip(1), lab.ns(0), lab.ns(1));
    let recv = format!(
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('{to}',9999))\n\
         s.settimeout(1.5)\nc=0\nprint('ready',flush=True)\ntry:\n    while True:\n        s.recv(64); c+=1\n\
         except OSError:\n    pass\nprint(c)"
    );
    let mut rx = Command::new("ip")
        .args(["netns", "exec", &ns1, "python3", "-c", &recv])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = rx.stdout.take().unwrap();
    let mut first = [0u8; 6];
    std::io::Read::read_exact(&mut out, &mut first).unwrap();
    let send = format!(
        "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
         for i in range({n}):\n    s.sendto(b'x',('{to}',9999)); time.sleep(0.002)"
    );
    let st = Command::new("ip")
        .args(["netns", "exec", &ns0, "python3", "-c", &send])
        .status()
        .unwrap();
    assert!(st.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    rx.wait().unwrap();
    rest.trim().parse().unwrap()
}

#[test]
fn partitions_drop_real_packets_loss_drops_some_and_the_lab_leaves_nothing() {
    let pid = std::process::id();
    let l = lab(2, "rules");
    assert!(resources_of(pid).len() >= 6, "{:?}", resources_of(pid));
    assert_eq!(delivered(&l, 200), 200);
    // Router 1 drops what comes from router 0 (rules sit on the receiving side).
    l.set_rules(1, &[0], &[], 0).unwrap();
    assert_eq!(delivered(&l, 200), 0);
    l.set_rules(1, &[], &[0], 50).unwrap();
    let some = delivered(&l, 400);
    assert!(
        (100..300).contains(&some),
        "{some} of 400 through at 50% loss"
    );
    l.heal().unwrap();
    assert_eq!(delivered(&l, 200), 200);
    drop(l);
    assert_eq!(resources_of(pid), Vec::<String>::new());

    // A panic while the lab is up: unwinding tears it down.
    let r = std::panic::catch_unwind(|| {
        let _l = lab(1, "panic");
        panic!("a scenario failed");
    });
    assert!(r.is_err());
    assert_eq!(resources_of(pid), Vec::<String>::new());
}

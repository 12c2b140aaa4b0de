use super::uplink::check_template;

#[test]
fn templates_must_use_known_placeholders() {
    assert!(check_template("site1/{device}/{topic}").is_ok());
    assert!(check_template("{topic}").is_ok());
    assert!(check_template("fixed/topic").is_err());
    assert!(check_template("a/{dev}/{topic}").is_err());
    assert!(check_template("a/{topic").is_err());
    assert!(check_template("a/+/{topic}").is_err());
}
